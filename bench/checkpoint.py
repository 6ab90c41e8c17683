"""Checkpoint benchmark, one run, everything side by side on the same ~160 MB state.

(a) training stall of ms_llm's async save vs synchronous torch.save / mindspore.save_checkpoint,
    and the peers' own full-state saves (torch DCP dcp.save, safetensors save_file). The state
    is a torch model's parameters; the overlapped save snapshots them beside that model's
    forward and backward (which only read them) and fences before the update, as the training
    loop does; the forward + backward's own time alone and beside the save shows what the
    copies cost the step on shared cores
(b) ms_llm save (persist) vs a raw write + fsync; same-strategy and cross-strategy (reshard)
    loads vs a raw read of the same bytes (the byte ranges, in the shard files, of the saved
    shards the load's pieces meet: one sequential read per range, one thread), page cache warm
    (every file read once, untimed, just before each timed read, so each starts with the same
    page cache and CPU caches) and cold (our own files evicted with posix_fadvise DONTNEED
    before each read); a reshard's bytes lie in two files, and a raw read of as many bytes from
    one file is shown beside it. The same two loads of a wider model's state (WIDE, ~470 MB,
    tensors of a few MB) show what per-tensor planning weighs once tensors are that large
(c) restore from the memory tier (/dev/shm, sealed by its keeper) vs from disk, cold page cache,
    and a raw read of the same bytes from /dev/shm on two threads: the floor of any restore that
    copies the bytes into the process
(d) full-state load, one rank, into existing tensors: ms_llm vs torch DCP dcp.load vs
    safetensors load_file + copy_ (what load_state_dict does); into a MindSpore net's
    Parameters: ms_llm's load_into vs mindspore.load_checkpoint (its own .ckpt of the same state)
(e) an index at scale: a SCALE_RANKS-rank ZeRO-3 save of a deep, narrow model (weights and both
    Adam moments, every rank a slice of every tensor), written rank by rank in this process.
    Rank 0's save to committed (it reads every rank's fragment and writes the index's head, in a
    child process) with the model's forward + backward run beside it, against the same steps just
    before, and the same save committed on rank 0's writer thread (commit_mod.CHILD_SHARDS raised
    above the save's shards for it); then one rank's open of the checkpoint and its load of its
    own pieces (the head and its own index part), against a plain json.loads of the whole index
    (head and every part, collector on), and an open that reads every part (as a verify does);
    then a pipeline-parallel save (PP_SAVED) loaded by rank 0 of another layout (PP_TARGET),
    which reads the parts of the ranks the head names for its tensors, against the same load
    from a head that does not name them (every part read); and the ZeRO-3 save loaded by rank 0
    of half as many ranks (ZERO_TARGET), which reads the parts of the savers whose even slices
    its own meet (the head's `split`), against the same load from a head without `split` (every
    part read)

    python bench/checkpoint.py            (make bench runs it too)

Each number is the median of REPEATS interleaved runs ((e): SCALE_REPEATS saves). Goals: stall ratio <= 0.05, load
throughput ratio >= 0.7, memory tier >= 5x faster than a cold disk. torch's OpenMP threads
sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, unless set): spinning after a peer's
row, they would take the machine's cores from whichever row runs next.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # read when torch loads its OpenMP runtime

from ms_llm.checkpoint import (Checkpoint, CheckpointWriter, SaveItem, SaveStats,  # noqa: E402
                               optim_pieces, param_pieces)
from ms_llm.checkpoint.reshard import layout_plan  # noqa: E402
from ms_llm.checkpoint.storage import commit as commit_mod  # noqa: E402
from ms_llm.checkpoint.storage.safetensors_io import read_header  # noqa: E402
from ms_llm.config.model import ModelConfig  # noqa: E402
from ms_llm.init import init_param  # noqa: E402
from ms_llm.run.memory_tier import MemoryTier  # noqa: E402
from ms_llm.strategy.ir import ParallelStrategy, ZeroSpec  # noqa: E402

# ~40M parameters = 160 MB in fp32.
MODEL = ModelConfig(name="bench", vocab_size=16384, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    ffn_hidden_size=1408, max_seq_len=256, dtype="float32")
# (b) again on wider layers (~470 MB): tensors of a few MB instead of MODEL's 0.5 MB average.
WIDE = ModelConfig(name="bench_wide", vocab_size=32768, hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
                   ffn_hidden_size=2816, max_seq_len=256, dtype="float32")
# (e): 80 layers x 9 tensors x (weights + 2 Adam moments), each split over SCALE_RANKS ranks.
SCALE = ModelConfig(name="bench_scale", vocab_size=1024, hidden_size=64, num_layers=80, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=128, max_seq_len=64, dtype="float32")
SCALE_RANKS = 32
# (e) again under pipeline parallelism: a 4-stage save, loaded by a rank of an 8-stage layout.
PP_SAVED = ParallelStrategy(pp=4, dp=8, zero=ZeroSpec(stage=1))
PP_TARGET = ParallelStrategy(pp=8, dp=4, zero=ZeroSpec(stage=1))
# (e) again as a reshard: rank 0 of a ZeRO-3 layout on half as many ranks loads the 32-rank save.
ZERO_TARGET = ParallelStrategy(dp=SCALE_RANKS // 2, zero=ZeroSpec(stage=3))
SCALE_REPEATS = 3
REPEATS = 9


def timed(fn, cpu: list[float] | None = None) -> float:
    """Wall seconds of fn(); its CPU seconds (this process, all threads) go to `cpu` when given:
    on a shared machine the CPU cost says what the wall clock cannot."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return wall


def drop_cache_file(f: Path) -> None:
    """Evict one of our own files from the page cache (POSIX_FADV_DONTNEED): a cold read."""
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def drop_cache(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            drop_cache_file(f)


def raw_write(path: Path, buf: memoryview) -> None:
    with open(path, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def raw_read(ranges: list[tuple[Path, int, int]], out: bytearray) -> None:
    """Read the files' byte ranges [start, stop), in order, into `out`, one thread."""
    view, done = memoryview(out), 0
    for path, start, stop in ranges:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            end = done + stop - start
            while done < end:
                n = f.readinto(view[done:end])
                if not n:
                    raise OSError(f"{path}: ended before byte {stop}")
                done += n


def saved_ranges(folder: Path, pieces: dict) -> list[tuple[Path, int, int]]:
    """The byte ranges (file, start, stop), in file order with neighbours merged, of the saved
    shards whose boxes meet the pieces: the bytes a load of them has to read."""
    spans: list[tuple[Path, int, int]] = []
    headers: dict[str, dict] = {}
    with Checkpoint.open(folder) as c:
        for name, piece in pieces.items():
            entry = c.entry(name)
            for _, shard in entry.shards_near(piece.region):
                if shard.file not in headers:
                    headers[shard.file] = read_header(str(c.folder / shard.file))[0]
                span = headers[shard.file][shard.key]
                spans.append((c.folder / shard.file, span.start, span.start + span.nbytes))
    merged: list[tuple[Path, int, int]] = []
    for path, start, stop in sorted(spans):
        if merged and merged[-1][0] == path and merged[-1][2] == start:
            merged[-1] = (path, merged[-1][1], stop)
        else:
            merged.append((path, start, stop))
    return merged


def raw_read_parallel(path: Path, nbytes: int, out: np.ndarray, threads: int = 2, chunk: int = 4 << 20) -> None:
    """Read the file's first `nbytes` into `out`, `chunk` bytes per preadv, on `threads` threads:
    the fastest plain copy of the bytes out of the page cache (the floor for a restore)."""
    fd = os.open(path, os.O_RDONLY)
    view = memoryview(out)

    def part(start: int) -> None:
        done, end = start, min(start + chunk, nbytes)
        while done < end:
            got = os.preadv(fd, [view[done:end]], done)
            if got <= 0:
                raise OSError(f"{path}: ended at byte {done}")
            done += got
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(0, nbytes, chunk)))
    finally:
        os.close(fd)


def main() -> int:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"interleaved runs per row (default {REPEATS})")
    REPEATS = parser.parse_args().repeats
    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("TMPDIR")))
    shm = Path("/dev/shm") / f"ms_llm_bench_{uuid.uuid4().hex}"
    try:
        return run(work, shm)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def warm(folder: Path) -> None:
    """Read every file of `folder` once: the page cache then holds all of it."""
    for f in folder.rglob("*"):
        if f.is_file():
            f.read_bytes()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def quiet_dcp(fn, *args, **kwargs):
    """dcp.save / dcp.load in one process (no_dist) without its per-call warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs, no_dist=True)


def save_sharded(folder: Path, state: dict, plan) -> None:
    """A checkpoint of `state` saved under `plan`, every rank's file written."""
    for rank in reversed(range(plan.world_size)):
        w = CheckpointWriter(folder, rank, plan.world_size, session=folder.name)
        w.save(1, [SaveItem(p, np.ascontiguousarray(state[n][tuple(slice(o, o + s) for o, s in zip(
            p.region.offsets, p.region.sizes))])) for n, p in param_pieces(plan, rank).items() if p.primary])
        w.close()


def load_vs_raw(folder: Path, pieces: dict) -> dict[str, float]:
    """Median seconds of loading `pieces` from `folder`, of a raw read of the same bytes and,
    when those lie in more than one file, of as many bytes from the first file; warm and cold,
    interleaved."""
    dest = {n: np.empty(p.local_shape, np.float32) for n, p in pieces.items()}     # the model's parameters
    nbytes = sum(a.nbytes for a in dest.values())
    out = bytearray(nbytes)
    same = saved_ranges(folder, pieces)
    if sum(stop - start for _, start, stop in same) != nbytes:
        raise SystemExit(f"bench: the saved shards the load meets hold other than its {nbytes} bytes")
    reads = {"raw": same}
    if len({path for path, _, _ in same}) > 1:
        reads["one_file"] = [(same[0][0], 0, nbytes)]

    def load():
        with Checkpoint.open(folder, rank=0) as c:      # the pieces are rank 0's; a trainer names its rank
            c.read_pieces(pieces, out=dest)
    runs = {"load": load, **{k: (lambda r=r: raw_read(r, out)) for k, r in reads.items()}}
    t: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for k, fn in runs.items():
            warm(folder)                  # before each timed read: the same page cache and CPU caches
            t.setdefault(k, []).append(timed(fn, t.setdefault(f"cpu_{k}", [])))
            drop_cache(folder)
            t.setdefault(f"cold_{k}", []).append(timed(fn, t.setdefault(f"cpu_cold_{k}", [])))
    return {"bytes": nbytes, **{k: med(v) for k, v in t.items()}}


def index_at_scale(work: Path, forward_backward) -> dict[str, float]:
    """(e): median seconds of rank 0's save to committed and of the forward + backward steps
    run beside it (against the same steps just before it), then of one rank's open and its
    load of its own pieces, a plain json.loads of the whole index (head and parts) and an open
    that reads every part (the parsed trees are kept until after the timing: freeing them is
    not part of any)."""
    plan = layout_plan(SCALE, ParallelStrategy(dp=SCALE_RANKS, zero=ZeroSpec(stage=3)), SCALE_RANKS)

    def pieces(rank: int) -> dict:
        return scale_pieces(plan, rank)

    def save(root: Path, rank: int) -> tuple[CheckpointWriter, SaveStats]:
        w = CheckpointWriter(root, rank, SCALE_RANKS, session=root.name)
        return w, w.save(1, [SaveItem(p, np.zeros(p.local_shape, np.float32)) for p in pieces(rank).values()
                             if p.primary])
    def save_all(root: Path, key: str) -> None:
        """Every rank's save, rank 0 last (its commit finds every fragment), the model's steps
        run beside rank 0's until it is committed, and the same steps just before."""
        for rank in reversed(range(1, SCALE_RANKS)):
            save(root, rank)[0].close()
        t["fb"] += [timed(forward_backward) for _ in range(2)]
        start = time.perf_counter()
        w, stats = save(root, 0)
        while not stats.done.is_set() and time.perf_counter() - start < 60:
            t[f"fb_{key}"].append(timed(forward_backward))
        w.close()
        t[key].append(time.perf_counter() - start)
    me = SCALE_RANKS // 2
    mine = pieces(me)
    t: dict[str, list[float]] = {k: [] for k in ("commit", "inline", "fb", "fb_commit", "fb_inline", "parse", "open",
                                                 "load", "open_all")}
    child_shards = commit_mod.CHILD_SHARDS
    for i in range(SCALE_REPEATS):
        commit_mod.CHILD_SHARDS = 1 << 62                 # the baseline: rank 0 merges on its writer thread
        try:
            save_all(work / f"inline{i}", "inline")
        finally:
            commit_mod.CHILD_SHARDS = child_shards
        shutil.rmtree(work / f"inline{i}")
        root = work / f"scale{i}"
        save_all(root, "commit")
        folder = next(root.glob("step_*"))
        files = [folder / "index.json", *sorted(folder.glob("index_*.json"))]
        kept: list = []
        gc.collect()
        t["parse"].append(timed(lambda: kept.extend(json.loads(f.read_bytes()) for f in files)))
        kept.clear()
        gc.collect()
        t["open"].append(timed(lambda: kept.append(Checkpoint.open(root, rank=me))))
        t["load"].append(timed(lambda: kept[0].read_pieces(mine)))
        kept[0].close()
        kept.clear()
        gc.collect()
        t["open_all"].append(timed(lambda: kept.append(len(Checkpoint.open(root).entry(next(iter(mine))).shards))))
        kept.clear()
        nbytes, head, own = (sum(f.stat().st_size for f in files), files[0].stat().st_size,
                             (folder / f"index_{me:05d}.json").stat().st_size)
        if i == SCALE_REPEATS - 1:
            zero = zero_reshard(folder)
        shutil.rmtree(root)
    return {"index_bytes": nbytes, "head_bytes": head, "own_bytes": own, "pieces": len(mine),
            **{k: med(v) for k, v in t.items()}, **zero, **stage_reshard(work)}


def without(folder: Path, key: str) -> Path:
    """A copy of a step folder whose head's tensors lack `key`, as heads written before it."""
    copy = folder.parent.parent / f"{folder.parent.name}_without_{key}" / folder.name
    shutil.copytree(folder, copy)
    head = json.loads((copy / "index.json").read_text())
    for entry in head["tensors"].values():
        entry.pop(key, None)
    (copy / "index.json").write_text(json.dumps(head))
    return copy


def interleaved_loads(pieces: dict, folders: dict[str, Path]) -> dict[str, float]:
    """Median seconds of rank 0's open + load of `pieces` from each folder, interleaved."""
    def load(where: Path) -> None:
        with Checkpoint(where, rank=0) as c:
            c.read_pieces(pieces)
    t: dict[str, list[float]] = {k: [] for k in folders}
    for _ in range(SCALE_REPEATS):
        for key, where in folders.items():
            gc.collect()
            t[key].append(timed(lambda: load(where)))
    return {k: med(v) for k, v in t.items()}


def zero_reshard(folder: Path) -> dict[str, float]:
    """(e), ZeRO-3 resharded: rank 0 of ZERO_TARGET loads its pieces from the SCALE_RANKS-rank
    save, reading the parts of the savers whose slices its own meet, against the same load from
    a copy whose head has no `split` (every saver's part)."""
    wanted = scale_pieces(layout_plan(SCALE, ZERO_TARGET, SCALE_RANKS // 2), 0)
    every = without(folder, "split")
    tensors = json.loads((folder / "index.json").read_text())["tensors"]
    split = [n for n in wanted if "split" in tensors[n]]
    with Checkpoint(folder, rank=0) as c:
        c.read_pieces(wanted)
        read = len(c.index.parts.parsed())
    times = interleaved_loads(wanted, {"named": folder, "every": every})
    shutil.rmtree(every.parent)
    return {"zero_pieces": len(wanted), "zero_split": len(split), "zero_parts": read,
            **{f"zero_{k}": v for k, v in times.items()}}


def stage_reshard(work: Path) -> dict[str, float]:
    """(e), pipeline parallel: rank 0 of PP_TARGET loads its pieces (one saved stage's tensors)
    from a PP_SAVED save, reading the parts of the ranks the head names for those tensors;
    against the same load from a copy whose head does not name them (one written before it
    did), which reads every part. Median seconds, interleaved."""
    saved, target = (layout_plan(SCALE, strategy, SCALE_RANKS) for strategy in (PP_SAVED, PP_TARGET))
    root = work / "pp"
    for rank in reversed(range(SCALE_RANKS)):
        w = CheckpointWriter(root, rank, SCALE_RANKS, session="pp")
        w.save(1, [SaveItem(p, np.zeros(p.local_shape, np.float32)) for p in scale_pieces(saved, rank).values()
                   if p.primary])
        w.close()
    folder = next(root.glob("step_*"))
    every = without(folder, "parts")
    wanted = scale_pieces(target, 0)
    tensors = json.loads((folder / "index.json").read_text())["tensors"]
    read = {r for n in wanted for a, b in tensors[n]["parts"] for r in range(a, b)}
    times = interleaved_loads(wanted, {"named": folder, "every": every})
    shutil.rmtree(root)
    shutil.rmtree(every.parent)
    return {"pp_pieces": len(wanted), "pp_parts": len(read), **{f"pp_{k}": v for k, v in times.items()}}


def scale_pieces(plan, rank: int) -> dict:
    """(e): a rank's weights and both Adam moments."""
    return param_pieces(plan, rank) | optim_pieces(plan, rank, ("exp_avg", "exp_avg_sq"))


def load_state(dest: dict, loaded: dict) -> None:
    """What model.load_state_dict does with load_file's tensors (which map the file lazily)."""
    for n, x in loaded.items():
        dest[n].copy_(x)


def mindspore_step(work: Path) -> dict[str, float]:
    """(a) on the MindSpore compiled step (ms_llm.mindspore.step.GraphStep, stand-alone, GRAPH mode, as the
    worker builds it) training MODEL: its whole training state (weights and both AdamW moments) saved with
    overlap as the shared loop saves it (held pieces, save_items, writer.save), the fence where the step
    calls it (after forward and backward, before the update), against mindspore.save_checkpoint of the
    same tensors; the step alone, beside the overlapped snapshot (and its persist), and with the fence
    first (the snapshot taken before the step, where it was while the update shared one graph with the
    forward and backward). Median seconds of REPEATS interleaved runs."""
    import mindspore as ms

    from ms_llm.config.schema import to_dict
    from ms_llm.job import job_from_dict
    from ms_llm.mindspore.state import MsTrainerState
    from ms_llm.mindspore.worker import build_graph_step
    from ms_llm.run import RunFolder
    from ms_llm.strategy.plan import plan

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    job = job_from_dict({"model": to_dict(MODEL, full=True),
                         "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
                         "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": 64, "steps": 1000}})
    mplan = plan(job.model, job.strategy, job.train)
    step = build_graph_step(job, mplan, RunFolder(work / "ms_run"), rank=0, world=1, ascend=False)
    step.compile()
    state = MsTrainerState(step, mplan, 0, 1)
    rows = np.random.default_rng(0).integers(0, MODEL.vocab_size, (1, 65)).astype(np.int32)
    steps, saves = itertools.count(), itertools.count(1)
    writer = CheckpointWriter(work / "ms_async", 0, 1, keep_last=2, session="ms-bench")

    def train_step(fence=lambda: None) -> None:
        step(next(steps), rows, fence)

    def snapshot(prep: list[float]) -> SaveStats:
        """What TrainerCheckpoints.save does on the training thread; its own time (the tensors'
        host views, on Ascend their device-to-host copies) goes to `prep`."""
        t0 = time.perf_counter()
        held = state.held(create=False)
        items = state.save_items({n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()})
        prep.append(time.perf_counter() - t0)
        return writer.save(next(saves), items, overlap=True)
    held = state.held(create=False)
    ms_list = [{"name": n, "data": t} for n, (_, t) in held.items()]
    nbytes = sum(t.nbytes for _, t in held.values())
    train_step()
    snapshot([])                           # the first save allocates and faults in the host buffer
    writer.wait()
    t: dict[str, list[float]] = {k: [] for k in ("step", "step_overlap", "prep", "stall", "step_first", "prep_first",
                                                 "stall_first", "ms_save")}
    for i in range(REPEATS):
        t["step"].append(timed(train_step))
        stats = snapshot(t["prep"])
        t["step_overlap"].append(timed(lambda: train_step(writer.fence)))
        writer.wait()
        os.sync()
        t["stall"].append(t["prep"][-1] + stats.stall_s)
        stats = snapshot(t["prep_first"])
        writer.fence()                     # the fence first: the snapshot copies before the step
        t["step_first"].append(timed(train_step))
        writer.wait()
        os.sync()
        t["stall_first"].append(t["prep_first"][-1] + stats.stall_s)
        t["ms_save"].append(timed(lambda: ms.save_checkpoint(ms_list, str(work / f"ms_state{i}.ckpt"))))
        (work / f"ms_state{i - 1}.ckpt").unlink(missing_ok=True)
        os.sync()
    writer.close()
    # Each round's step beside the snapshot over its own step alone: a shared machine's load drifts
    # between rounds more than the snapshot costs.
    paired = {f"{k}_ratio": med([x / y for x, y in zip(t[k], t["step"])]) for k in ("step_overlap", "step_first")}
    return {"bytes": nbytes, "tensors": len(ms_list), **{k: med(v) for k, v in t.items()}, **paired}


def mindspore_rows(m: dict[str, float] | None) -> list[tuple[str, str, str]]:
    """(a)'s rows of the MindSpore compiled step (mindspore_step); none without MindSpore."""
    if m is None:
        return []
    return [
        (f"    MindSpore compiled step, stall per save ({m['bytes'] / 1e6:.0f} MB: weights + Adam moments)",
         f"{m['stall'] * 1e3:8.1f} ms", f"stall ratio {m['stall'] / m['ms_save']:.3f} (goal <= 0.05); held + "
                                       f"save_items {m['prep'] * 1e3:.1f} ms of it; fenced before the update"),
        ("      the same with the fence first (snapshot before the step)", f"{m['stall_first'] * 1e3:8.1f} ms",
         f"stall ratio {m['stall_first'] / m['ms_save']:.3f}"),
        ("      mindspore.save_checkpoint of the same tensors", f"{m['ms_save'] * 1e3:8.1f} ms", ""),
        ("      the step (1 x 64 tokens) alone", f"{m['step'] * 1e3:8.1f} ms", ""),
        ("      beside the overlapped snapshot + persist", f"{m['step_overlap'] * 1e3:8.1f} ms",
         f"{m['step_overlap_ratio']:.3f}x the step alone, per round (goal <= 1.05)"),
        ("      after the snapshot taken before it (beside its persist)", f"{m['step_first'] * 1e3:8.1f} ms",
         f"{m['step_first_ratio']:.3f}x"),
    ]


def run(work: Path, shm: Path) -> int:
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    one = layout_plan(MODEL, ParallelStrategy(dp=1), 1)
    state = {n: init_param(n, p.shape, 0, std=1.0) for n, p in one.params.items()}
    nbytes = sum(a.nbytes for a in state.values())
    pieces = param_pieces(one, 0)
    items = [SaveItem(p, state[n]) for n, p in pieces.items()]
    print(f"checkpoint bench: {len(state)} tensors, {nbytes / 1e6:.0f} MB fp32, one rank, median of {REPEATS}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")

    # ---- (a) stall, and the peers' full-state saves -----------------------------------
    from torch_backend.apply import cross_entropy
    from torch_backend.model import Transformer

    torch.manual_seed(0)
    model = Transformer(MODEL)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, a in state.items():
            params[n].copy_(torch.from_numpy(a))
    model_items = [SaveItem(p, params[n].detach().numpy()) for n, p in pieces.items()]
    batch = torch.randint(0, MODEL.vocab_size, (1, 65), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> None:
        cross_entropy(model(batch[:, :-1]), batch[:, 1:]).backward()
    torch_state = {n: torch.from_numpy(a) for n, a in state.items()}
    writer = CheckpointWriter(work / "async", 0, 1, keep_last=2, session="bench")
    writer.save(0, model_items)            # first save allocates and faults in the host buffer
    writer.wait()
    forward_backward()
    t: dict[str, list[float]] = {k: [] for k in ("stall", "stall_plain", "fb", "fb_overlap", "fb_persist", "total",
                                                 "persist", "raw_write", "torch", "ms", "dcp", "st")}
    try:
        import mindspore as ms
        ms_list = [{"name": n, "data": ms.Tensor(a)} for n, a in state.items()]
    except ImportError:
        ms = None
    buf = memoryview(np.concatenate([a.reshape(-1) for a in state.values()]).view(np.uint8))
    for i in range(1, REPEATS + 1):
        t["fb"].append(timed(forward_backward))
        stats = writer.save(2 * i - 1, model_items, overlap=True)
        t["fb_overlap"].append(timed(forward_backward))
        writer.fence()                    # the update may now write the parameters
        writer.wait()
        os.sync()                         # untimed: deletions and dirty pages settle before the next one
        t["stall"].append(stats.stall_s)
        t["total"].append(stats.total_s)
        t["persist"].append(stats.persist_s)
        stats = writer.save(2 * i, model_items)
        t["fb_persist"].append(timed(forward_backward))
        writer.wait()
        os.sync()
        t["stall_plain"].append(stats.stall_s)
        t["raw_write"].append(timed(lambda: raw_write(work / f"raw{i}.bin", buf)))      # (b), interleaved
        (work / f"raw{i - 2}.bin").unlink(missing_ok=True)    # the same retention as keep_last=2
        os.sync()
        t["torch"].append(timed(lambda: torch.save(torch_state, work / f"torch{i}.pt")))
        os.sync()
        if ms is not None:
            t["ms"].append(timed(lambda: ms.save_checkpoint(ms_list, str(work / f"ms{i}.ckpt"))))
            os.sync()
        t["dcp"].append(timed(lambda: quiet_dcp(dcp.save, torch_state,
                                                storage_writer=dcp.FileSystemWriter(str(work / f"dcp{i}")))))
        shutil.rmtree(work / f"dcp{i - 1}", ignore_errors=True)
        os.sync()
        t["st"].append(timed(lambda: safetensors.torch.save_file(torch_state, str(work / f"st{i}.safetensors"))))
        (work / f"st{i - 1}.safetensors").unlink(missing_ok=True)
        os.sync()
    writer.close()
    del model, params, model_items          # the loads below run without the model's memory around
    a = {k: med(v) for k, v in t.items() if v}
    m = mindspore_step(work) if ms is not None else None

    # ---- (b) same-strategy and reshard loads ------------------------------------------------
    # Checkpoints saved under tp4 (four shard files) and under dp1 (one file). Same strategy:
    # rank 0 of tp4 reads its own shard; reshard: rank 0 of tp2 x pp2 reads half of two shards.
    tp4, target = layout_plan(MODEL, ParallelStrategy(tp=4), 4), layout_plan(MODEL, ParallelStrategy(tp=2, pp=2), 4)
    save_sharded(work / "tp4", state, tp4)
    tp4_pieces = param_pieces(tp4, 0)
    same = load_vs_raw(work / "tp4", tp4_pieces)
    cross = load_vs_raw(work / "tp4", param_pieces(target, 0))
    wide_tp4, wide_target = (layout_plan(WIDE, ParallelStrategy(tp=4), 4),
                             layout_plan(WIDE, ParallelStrategy(tp=2, pp=2), 4))
    wide_one = layout_plan(WIDE, ParallelStrategy(dp=1), 1)
    wide_state = {n: init_param(n, p.shape, 0, std=1.0) for n, p in wide_one.params.items()}
    save_sharded(work / "wide", wide_state, wide_tp4)
    del wide_state
    wide_pieces = param_pieces(wide_tp4, 0)
    wide_same = load_vs_raw(work / "wide", wide_pieces)
    wide_cross = load_vs_raw(work / "wide", param_pieces(wide_target, 0))
    shutil.rmtree(work / "wide")

    # ---- (c) memory tier vs disk, (d) full-state loads vs the peers --------------------------
    tier = MemoryTier(shm, ttl_s=120)
    writer = CheckpointWriter(work / "tiered", 0, 1, session="tier", memory=tier)
    writer.save(1, items)
    writer.close()
    keeper = tier.keeper_pid()
    sealed = tier.latest() / "sealed.json"
    deadline = time.monotonic() + 60           # the keeper verifies and seals within a poll or two
    while not sealed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not sealed.exists():
        print("warning: the keeper did not seal the memory-tier checkpoint; memory rows include checksums")
    params = {n: np.empty(p.local_shape, np.float32) for n, p in pieces.items()}
    dcp_dest = {n: torch.empty_like(x) for n, x in torch_state.items()}
    st_dest = {n: torch.empty_like(x) for n, x in torch_state.items()}
    dcp_dir, st_file = work / f"dcp{REPEATS}", work / f"st{REPEATS}.safetensors"

    def restore(folder):
        with Checkpoint.open(folder, rank=0) as c:
            c.read_pieces(pieces, out=params)
    loads = {
        "ours": lambda: restore(work / "tiered"),
        "dcp": lambda: quiet_dcp(dcp.load, dcp_dest, storage_reader=dcp.FileSystemReader(str(dcp_dir))),
        "st": lambda: load_state(st_dest, safetensors.torch.load_file(str(st_file))),
    }
    where = {"ours": work / "tiered", "dcp": dcp_dir, "st": st_file}
    if ms is not None:
        from ms_llm.mindspore.checkpoint import load_into as ms_load_into
        ms_net = ms.nn.Cell()
        ms_net.weights = ms.ParameterTuple([ms.Parameter(ms.Tensor(np.zeros_like(a)), name=n)
                                            for n, a in state.items()])
        ms_params = {p.name: p for p in ms_net.weights}
        ms_file = work / f"ms{REPEATS}.ckpt"

        def ms_restore() -> None:
            with Checkpoint.open(work / "tiered", rank=0) as c:
                ms_load_into(c, pieces, ms_params)
        loads |= {"ms_ours": ms_restore, "ms": lambda: ms.load_checkpoint(str(ms_file), ms_net)}
        where |= {"ms_ours": work / "tiered", "ms": ms_file}
    shm_file = next(tier.latest().glob("rank_*.safetensors"))
    shm_out = np.empty(nbytes, np.uint8)
    t = {k: [] for k in ("mem", "cpu_mem", "mem_raw", "cpu_cold_ours", *loads, *(f"cold_{k}" for k in loads))}
    for _ in range(REPEATS):
        warm(shm)
        t["mem"].append(timed(lambda: restore(shm), t["cpu_mem"]))
        warm(shm)
        t["mem_raw"].append(timed(lambda: raw_read_parallel(shm_file, nbytes, shm_out)))
        for k, fn in loads.items():
            warm(where[k]) if where[k].is_dir() else where[k].read_bytes()
            t[k].append(timed(fn))
            drop_cache(where[k]) if where[k].is_dir() else drop_cache_file(where[k])
            t[f"cold_{k}"].append(timed(fn, t["cpu_cold_ours"] if k == "ours" else None))
    d = {k: med(v) for k, v in t.items()}
    tier.finish()
    deadline = time.monotonic() + 10
    while shm.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if shm.exists() and keeper:
        os.kill(keeper, 9)
        shutil.rmtree(shm, ignore_errors=True)
    torch.manual_seed(0)
    model = Transformer(MODEL)
    scale = index_at_scale(work, forward_backward)
    del model

    mb = nbytes / 1e6
    goal = "(goal <= 0.05)"
    rows = [
        ("(a) stall per save: ms_llm async, snapshot overlapped", f"{a['stall'] * 1e3:8.1f} ms",
         "save() + fence(): the snapshot copies beside the forward + backward"),
        ("    ms_llm async, snapshot taken inside save()", f"{a['stall_plain'] * 1e3:8.1f} ms", ""),
        ("    torch.save, synchronous", f"{a['torch'] * 1e3:8.1f} ms", f"stall ratio {a['stall'] / a['torch']:.3f} {goal}"),
    ]
    if "ms" in a:
        rows.append(("    mindspore.save_checkpoint, synchronous", f"{a['ms'] * 1e3:8.1f} ms",
                     f"stall ratio {a['stall'] / a['ms']:.3f} {goal}"))
    rows += [
        ("    torch DCP dcp.save (fsyncs), synchronous", f"{a['dcp'] * 1e3:8.1f} ms", f"stall ratio {a['stall'] / a['dcp']:.3f}"),
        ("    safetensors save_file, synchronous", f"{a['st'] * 1e3:8.1f} ms", f"stall ratio {a['stall'] / a['st']:.3f}"),
        ("    ms_llm save to durable (background)", f"{a['total'] * 1e3:8.1f} ms", ""),
        ("    forward + backward (1 x 64 tokens) alone", f"{a['fb'] * 1e3:8.1f} ms", ""),
        ("      beside the overlapped snapshot + persist", f"{a['fb_overlap'] * 1e3:8.1f} ms",
         f"{(a['fb_overlap'] - a['fb']) * 1e3:+.1f} ms: the copies and the persist share the cores"),
        ("      beside the persist only", f"{a['fb_persist'] * 1e3:8.1f} ms",
         f"{(a['fb_persist'] - a['fb']) * 1e3:+.1f} ms"),
        *mindspore_rows(m),
        ("(b) save: ms_llm persist (crc32c + write + fsync)", f"{mb / a['persist']:8.0f} MB/s", ""),
        ("    raw write + fsync of the same bytes", f"{mb / a['raw_write']:8.0f} MB/s",
         f"throughput ratio {a['raw_write'] / a['persist']:.2f}"),
    ]
    def per_tensor(r: dict, pieces: dict) -> str:
        return f"{r['bytes'] / len(pieces) / 1e6:.1f} MB a tensor"
    loads_b = [(f"same strategy tp4 -> tp4 ({per_tensor(same, tp4_pieces)})", same),
               ("reshard tp4 -> tp2 x pp2", cross),
               (f"same strategy, wider layers ({per_tensor(wide_same, wide_pieces)})", wide_same),
               ("reshard, wider layers", wide_cross)]
    for label, r in loads_b:
        rmb = r["bytes"] / 1e6
        one_file = [("      raw read of as many bytes from one file", f"{rmb / r['one_file']:8.0f} MB/s",
                     f"throughput ratio {r['one_file'] / r['load']:.2f}")] if "one_file" in r else []
        cold_one_file = [("      raw read, cold, as many bytes from one file", f"{rmb / r['cold_one_file']:8.0f} MB/s",
                          f"throughput ratio {r['cold_one_file'] / r['cold_load']:.2f}")] if "one_file" in r else []
        rows += [
            (f"    ms_llm load {label} (rank 0)", f"{rmb / r['load']:8.0f} MB/s", f"CPU {r['cpu_load'] * 1e3:.0f} ms"),
            ("      raw read of the same bytes", f"{rmb / r['raw']:8.0f} MB/s",
             f"CPU {r['cpu_raw'] * 1e3:.0f} ms; throughput ratio {r['raw'] / r['load']:.2f} (goal >= 0.7)"),
            *one_file,
            ("      the same load, cold page cache", f"{rmb / r['cold_load']:8.0f} MB/s",
             f"CPU {r['cpu_cold_load'] * 1e3:.0f} ms"),
            ("      raw read of the same bytes, cold page cache", f"{rmb / r['cold_raw']:8.0f} MB/s",
             f"CPU {r['cpu_cold_raw'] * 1e3:.0f} ms; throughput ratio {r['cold_raw'] / r['cold_load']:.2f} (goal >= 0.7)"),
            *cold_one_file,
        ]
    rows += [
        ("(c) restore: memory tier (/dev/shm, sealed)", f"{d['mem'] * 1e3:8.1f} ms", f"CPU {d['cpu_mem'] * 1e3:.0f} ms"),
        ("      raw read of the same bytes from /dev/shm", f"{d['mem_raw'] * 1e3:8.1f} ms",
         f"2 threads, 4 MiB per preadv; the restore takes {d['mem'] / d['mem_raw']:.2f}x its time"),
        ("    restore: disk, cold page cache", f"{d['cold_ours'] * 1e3:8.1f} ms",
         f"CPU {d['cpu_cold_ours'] * 1e3:.0f} ms; memory tier {d['cold_ours'] / d['mem']:.1f}x faster (goal >= 5x), "
         f"the raw /dev/shm read {d['cold_ours'] / d['mem_raw']:.1f}x"),
        ("(d) full-state load: ms_llm, warm / cold", f"{d['ours'] * 1e3:8.1f} ms", f"{d['cold_ours'] * 1e3:8.1f} ms cold"),
        ("    torch DCP dcp.load, warm / cold", f"{d['dcp'] * 1e3:8.1f} ms",
         f"{d['cold_dcp'] * 1e3:8.1f} ms cold; ms_llm {d['dcp'] / d['ours']:.1f}x / {d['cold_dcp'] / d['cold_ours']:.1f}x"),
        ("    safetensors load_file + copy_, warm / cold", f"{d['st'] * 1e3:8.1f} ms",
         f"{d['cold_st'] * 1e3:8.1f} ms cold; ms_llm {d['st'] / d['ours']:.1f}x / {d['cold_st'] / d['cold_ours']:.1f}x"),
    ]
    if "ms" in d:
        rows += [
            ("    into MindSpore Parameters: ms_llm load_into, warm / cold", f"{d['ms_ours'] * 1e3:8.1f} ms",
             f"{d['cold_ms_ours'] * 1e3:8.1f} ms cold"),
            ("    mindspore.load_checkpoint into the net, warm / cold", f"{d['ms'] * 1e3:8.1f} ms",
             f"{d['cold_ms'] * 1e3:8.1f} ms cold; ms_llm {d['ms'] / d['ms_ours']:.1f}x / "
             f"{d['cold_ms'] / d['cold_ms_ours']:.1f}x"),
        ]
    rows += [
        (f"(e) {SCALE_RANKS}-rank ZeRO-3 index ({SCALE.num_layers} layers, weights + Adam moments)",
         f"{scale['index_bytes'] / 1e6:8.1f} MB", f"{scale['pieces']} pieces a rank; head "
         f"{scale['head_bytes'] / 1e6:.2f} MB, a rank's part {scale['own_bytes'] / 1e6:.2f} MB"),
        ("    rank 0's save to committed (reads every fragment)", f"{scale['commit'] * 1e3:8.0f} ms",
         "the commit in a child process"),
        ("    forward + backward beside it", f"{scale['fb_commit'] * 1e3:8.0f} ms",
         f"{scale['fb_commit'] / scale['fb']:.2f}x its time just before ({scale['fb'] * 1e3:.0f} ms)"),
        ("    the same save, committed on rank 0's writer thread", f"{scale['inline'] * 1e3:8.0f} ms", ""),
        ("      forward + backward beside it", f"{scale['fb_inline'] * 1e3:8.0f} ms",
         f"{scale['fb_inline'] / scale['fb']:.2f}x; the commit holds the interpreter lock the steps need"),
        ("    open on one rank (the head)", f"{scale['open'] * 1e3:8.1f} ms", ""),
        ("    that rank's load of its own pieces (its part)", f"{scale['load'] * 1e3:8.1f} ms",
         f"open + load {(scale['open'] + scale['load']) / scale['parse']:.2f}x the time of a plain parse"),
        ("      json.loads of the whole index, collector on", f"{scale['parse'] * 1e3:8.1f} ms", ""),
        ("    an open that reads every part (a verify's)", f"{scale['open_all'] * 1e3:8.1f} ms",
         f"{scale['open_all'] / scale['parse']:.2f}x the plain parse"),
        (f"    pp4 x dp8 save, rank 0 of pp8 x dp4 loads its {scale['pp_pieces']} pieces",
         f"{scale['pp_named'] * 1e3:8.1f} ms", f"reads the {scale['pp_parts']} of {SCALE_RANKS} parts the head "
                                              f"names for its tensors"),
        ("      the same load, head without per-tensor ranks", f"{scale['pp_every'] * 1e3:8.1f} ms",
         f"every part; {scale['pp_every'] / scale['pp_named']:.1f}x the time"),
        (f"    rank 0 of dp{SCALE_RANKS // 2} ZeRO-3 loads its {scale['zero_pieces']} pieces",
         f"{scale['zero_named'] * 1e3:8.1f} ms", f"reads {scale['zero_parts']} of {SCALE_RANKS} parts, those of the "
                                                f"savers whose slices meet its own ({scale['zero_split']} tensors split)"),
        ("      the same load, head without split", f"{scale['zero_every'] * 1e3:8.1f} ms",
         f"every part; {scale['zero_every'] / scale['zero_named']:.1f}x the time"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
