"""Checkpoint benchmark, one run, everything side by side on the same ~160 MB state.

(a) training stall of ms_llm's async save vs synchronous torch.save / mindspore.save_checkpoint
(b) ms_llm save (persist) and reshard-load throughput vs a raw write / read of the same bytes
    (page cache warm, then cold: our own files evicted with posix_fadvise before each read)
(c) restore from the memory tier (/dev/shm) vs from disk with a cold page cache

    python bench/checkpoint.py            (make bench runs it too)

Each number is the median of REPEATS interleaved runs. Goals: stall ratio <= 0.1,
throughput ratio >= 0.5.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.checkpoint import Checkpoint, CheckpointWriter, MemoryTier, SaveItem, param_pieces  # noqa: E402
from ms_llm.checkpoint.reshard import layout_plan  # noqa: E402
from ms_llm.config.model import ModelConfig  # noqa: E402
from ms_llm.init import init_param  # noqa: E402
from ms_llm.strategy.ir import ParallelStrategy  # noqa: E402

# ~40M parameters = 160 MB in fp32.
MODEL = ModelConfig(name="bench", vocab_size=16384, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    ffn_hidden_size=1408, max_seq_len=256, dtype="float32")
REPEATS = 5


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(folder: Path) -> None:
    """Evict our own files from the page cache (POSIX_FADV_DONTNEED): a cold read."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def raw_write(path: Path, buf: memoryview) -> None:
    with open(path, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def raw_read(paths: list[Path], nbytes: int, out: bytearray) -> None:
    """Read `nbytes` from the files in order into `out` (the same bytes a loader would move)."""
    view, done = memoryview(out), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while done < nbytes:
                n = f.readinto(view[done:nbytes])
                if not n:
                    break
                done += n


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("TMPDIR")))
    shm = Path("/dev/shm") / f"ms_llm_bench_{uuid.uuid4().hex}"
    try:
        return run(work, shm)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, shm: Path) -> int:
    one = layout_plan(MODEL, ParallelStrategy(dp=1), 1)
    state = {n: init_param(n, p.shape, 0, std=1.0) for n, p in one.params.items()}
    nbytes = sum(a.nbytes for a in state.values())
    pieces = param_pieces(one, 0)
    items = [SaveItem(p, state[n]) for n, p in pieces.items()]
    print(f"checkpoint bench: {len(state)} tensors, {nbytes / 1e6:.0f} MB fp32, one rank, median of {REPEATS}")

    # ---- (a) stall ----------------------------------------------------------------------
    import torch
    torch_state = {n: torch.from_numpy(a) for n, a in state.items()}
    writer = CheckpointWriter(work / "async", 0, 1, keep_last=2, session="bench")
    writer.save(0, items)                  # first save allocates and faults in the host buffer
    writer.wait()
    stalls, totals, persists, torch_saves, ms_saves = [], [], [], [], []
    try:
        import mindspore as ms
        ms_list = [{"name": n, "data": ms.Tensor(a)} for n, a in state.items()]
    except ImportError:
        ms = None
    buf = memoryview(np.concatenate([a.reshape(-1) for a in state.values()]).view(np.uint8))
    raw_writes = []
    for i in range(1, REPEATS + 1):
        stats = writer.save(i, items)
        writer.wait()
        os.sync()                         # untimed: deletions and dirty pages settle before the next one
        stalls.append(stats.stall_s)
        totals.append(stats.total_s)
        persists.append(stats.persist_s)
        raw_writes.append(timed(lambda: raw_write(work / f"raw{i}.bin", buf)))      # (b), interleaved
        (work / f"raw{i - 2}.bin").unlink(missing_ok=True)    # the same retention as keep_last=2
        os.sync()
        torch_saves.append(timed(lambda: torch.save(torch_state, work / f"torch{i}.pt")))
        os.sync()
        if ms is not None:
            ms_saves.append(timed(lambda: ms.save_checkpoint(ms_list, str(work / f"ms{i}.ckpt"))))
            os.sync()
    writer.close()
    stall, total, t_torch = statistics.median(stalls), statistics.median(totals), statistics.median(torch_saves)
    persist, t_raw_write = statistics.median(persists), statistics.median(raw_writes)

    # ---- (b) throughput ------------------------------------------------------------------
    # A checkpoint saved under tp4 (four shard files), loaded by rank 0 of tp2 x pp2.
    tp4, target = layout_plan(MODEL, ParallelStrategy(tp=4), 4), layout_plan(MODEL, ParallelStrategy(tp=2, pp=2), 4)
    for rank in reversed(range(4)):
        w = CheckpointWriter(work / "tp4", rank, 4, session="tp4")
        w.save(1, [SaveItem(p, np.ascontiguousarray(state[n][tuple(slice(o, o + s) for o, s in zip(
            p.region.offsets, p.region.sizes))])) for n, p in param_pieces(tp4, rank).items() if p.primary])
        w.close()
    want = param_pieces(target, 0)
    want_bytes = sum(p.region.numel * 4 for p in want.values())

    dest = {n: np.empty(p.local_shape, np.float32) for n, p in want.items()}     # the model's parameters

    def reshard_load():
        with Checkpoint.open(work / "tp4") as c:
            c.read_pieces(want, out=dest)
    files = sorted((work / "tp4").glob("step_*/rank_*.safetensors"))
    out = bytearray(want_bytes)
    loads, raw_reads, cold_loads, cold_reads = [], [], [], []
    for _ in range(REPEATS):
        loads.append(timed(reshard_load))
        raw_reads.append(timed(lambda: raw_read(files, want_bytes, out)))
        drop_cache(work / "tp4")
        cold_loads.append(timed(reshard_load))
        drop_cache(work / "tp4")
        cold_reads.append(timed(lambda: raw_read(files, want_bytes, out)))
    t_load, t_raw_read = statistics.median(loads), statistics.median(raw_reads)
    t_cold_load, t_cold_read = statistics.median(cold_loads), statistics.median(cold_reads)

    # ---- (c) memory tier vs disk ---------------------------------------------------------
    tier = MemoryTier(shm, ttl_s=120)
    writer = CheckpointWriter(work / "tiered", 0, 1, session="tier", memory=tier)
    writer.save(1, items)
    writer.close()
    keeper = tier.keeper_pid()

    params = {n: np.empty(p.local_shape, np.float32) for n, p in pieces.items()}

    def restore(folder):
        with Checkpoint.open(folder) as c:
            c.read_pieces(pieces, out=params)
    mem_loads, disk_loads = [], []
    for _ in range(REPEATS):
        mem_loads.append(timed(lambda: restore(shm)))
        drop_cache(work / "tiered")
        disk_loads.append(timed(lambda: restore(work / "tiered")))
    t_mem, t_disk = statistics.median(mem_loads), statistics.median(disk_loads)
    tier.finish()
    deadline = time.monotonic() + 10
    while shm.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if shm.exists() and keeper:
        os.kill(keeper, 9)
        shutil.rmtree(shm, ignore_errors=True)

    mb = nbytes / 1e6
    rows = [
        ("(a) stall per save: ms_llm async (snapshot only)", f"{stall * 1e3:8.1f} ms", ""),
        ("    torch.save, synchronous", f"{t_torch * 1e3:8.1f} ms", f"stall ratio {stall / t_torch:.3f} (goal <= 0.1)"),
    ]
    if ms_saves:
        t_ms = statistics.median(ms_saves)
        rows.append(("    mindspore.save_checkpoint, synchronous", f"{t_ms * 1e3:8.1f} ms",
                     f"stall ratio {stall / t_ms:.3f} (goal <= 0.1)"))
    rows += [
        ("    ms_llm save to durable (background)", f"{total * 1e3:8.1f} ms", ""),
        ("(b) save: ms_llm persist (crc32 + write + fsync)", f"{mb / persist:8.0f} MB/s", ""),
        ("    raw write + fsync of the same bytes", f"{mb / t_raw_write:8.0f} MB/s",
         f"throughput ratio {t_raw_write / persist:.2f} (goal >= 0.5)"),
        ("    ms_llm reshard load tp4 -> tp2 x pp2 (rank 0)", f"{want_bytes / 1e6 / t_load:8.0f} MB/s", ""),
        ("    raw read of the same bytes", f"{want_bytes / 1e6 / t_raw_read:8.0f} MB/s",
         f"throughput ratio {t_raw_read / t_load:.2f} (goal >= 0.5)"),
        ("    the same load, cold page cache", f"{want_bytes / 1e6 / t_cold_load:8.0f} MB/s", ""),
        ("    raw read, cold page cache", f"{want_bytes / 1e6 / t_cold_read:8.0f} MB/s",
         f"throughput ratio {t_cold_read / t_cold_load:.2f} (goal >= 0.5)"),
        ("(c) restore: memory tier (/dev/shm)", f"{t_mem * 1e3:8.1f} ms", ""),
        ("    restore: disk, cold page cache", f"{t_disk * 1e3:8.1f} ms", f"memory/disk time ratio {t_mem / t_disk:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
