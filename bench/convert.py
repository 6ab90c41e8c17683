"""Whole-run conversion, one run: import and export of a ~1 GB training state (fp32 weights and both
Adam moments) through ms_llm's streaming writer and each peer format's module, against a raw read
of the same bytes and the peers' own conversion tools.

    .venv/bin/python bench/convert.py [--gb 1.0] [--format all|ms_llm|megatron|deepspeed|torchtitan|mindformers]

Every row runs in a child process of its own, so its peak RSS (getrusage's ru_maxrss) is its own;
the child's RSS just before the conversion starts (imports, the opened source) is the fixed
overhead, and the memory goal is peak < that + 2 x the largest tensor (printed beside it). Inputs
are fsynced and dropped from the page cache (posix_fadvise DONTNEED) before each row, so every row
reads from the disk, as the raw read does. MB/s counts the bytes a row reads.
  raw read          the source file read tensor by tensor (numpy.fromfile): the floor for every row
  raw copy          the same reads written to one file and fsynced: the floor for a conversion
  ms_llm import     write_foreign_run of a ForeignRun whose tensors read that file: the core of import-run
  hf export         export-run --to hf: the weights of the imported checkpoint as a Hugging Face folder
  <peer> export     the format's write_run from the imported checkpoint (export-run --to <peer>)
  <peer> import     the format's read_run of that export, then write_foreign_run (import-run); Megatron-LM's
                    with the run's train script as --config, as a user passes it
  <peer> tool       the peer's own conversion of that export: torch DCP's dcp_to_torch_save
                    (torchtitan), DeepSpeed's zero_to_fp32; Megatron-core and MindFormers ship none
A peer row whose module does not import yet, or that fails, prints "not available: <reason>".
Goal (issue 36): at least the peer tool's speed at most half its peak memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_llm.checkpoint import optim_name  # noqa: E402
from ms_llm.checkpoint.reshard import layout_plan  # noqa: E402
from ms_llm.config.model import ModelConfig  # noqa: E402
from ms_llm.errors import MsLlmError  # noqa: E402
from ms_llm.strategy.ir import ParallelStrategy  # noqa: E402

PEER_FORMATS = ("megatron", "deepspeed", "torchtitan", "mindformers")
VOCAB, LAYERS = 32000, 4
MOMENTS = ("exp_avg", "exp_avg_sq")


def bench_model(gb: float) -> ModelConfig:
    """A LLaMA of 4 layers whose fp32 weights and two moments come to about `gb` GB:
    12 bytes a parameter, 2 x VOCAB x h + LAYERS x 45 h^2 parameters (attention 3 h^2 with half
    the heads for k/v, SwiGLU 3 x 2.75 h^2, norms aside)."""
    params, a, b = gb * 1e9 / 12, 45 / 4 * LAYERS, 2 * VOCAB          # a h^2 + b h = params
    h = max(128, int(round((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a) / 128)) * 128)
    return ModelConfig(name="convert_bench", vocab_size=VOCAB, hidden_size=h, num_layers=LAYERS, num_heads=h // 64,
                       num_kv_heads=h // 128, ffn_hidden_size=int(round(2.75 * h / 64)) * 64, max_seq_len=256,
                       dtype="float32")


def layout(model: ModelConfig) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, byte offset in the source file) of every weight and moment, fp32."""
    out, offset = [], 0
    for name, p in layout_plan(model, ParallelStrategy(dp=1), 1).params.items():
        for tensor in (name, *(optim_name(m, name) for m in MOMENTS)):
            out.append((tensor, tuple(p.shape), offset))
            offset += math.prod(p.shape) * 4
    return out


def write_source(path: Path, tensors: list[tuple[str, tuple[int, ...], int]]) -> int:
    """The state as one flat file, tensor after tensor (untimed): what the rows read."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _, shape, _ in tensors:
            rng.random(shape, dtype=np.float32).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def drop_cache(folder: Path) -> None:
    """Write back and drop every file under `folder` from the page cache."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


# ---- the rows, each in a child process ---------------------------------------------------------
def rss_kb() -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:"))


def foreign_run(work: Path):
    """The source file as a ForeignRun: each tensor read with numpy.fromfile when asked."""
    from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
    meta = json.loads((work / "source.json").read_text())
    model = ModelConfig(**meta["model"])
    source = str(work / "source.bin")

    def reader(shape, offset):
        return lambda: np.fromfile(source, np.float32, math.prod(shape), offset=offset).reshape(shape)
    tensors = {n: LazyTensor(tuple(s), "float32", reader(tuple(s), o)) for n, s, o in meta["tensors"]}
    return ForeignRun("bench", model, 100, tensors, {"optimizer_step": 100, "lr": 3e-4})


def child(role: str, fmt: str, work: Path) -> dict:
    """Run one row; returns seconds, the RSS before it and the bytes it read."""
    from ms_llm.checkpoint import Checkpoint
    from ms_llm.checkpoint.interop.run_state import write_foreign_run

    ckpt_root, export = work / "ckpt", work / f"export_{fmt}"
    if role == "raw":
        run = foreign_run(work)
        before, start = rss_kb(), time.perf_counter()
        nbytes = sum(t.read().nbytes for t in run.tensors.values())
        return {"s": time.perf_counter() - start, "rss0": before, "bytes": nbytes}
    if role == "copy":
        run = foreign_run(work)
        before, start = rss_kb(), time.perf_counter()
        with open(work / "copy.bin", "wb") as f:
            for tensor in run.tensors.values():
                f.write(memoryview(tensor.read()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        (work / "copy.bin").unlink()
        return {"s": seconds, "rss0": before, "bytes": sum(math.prod(t.shape) * 4 for t in run.tensors.values())}
    if role == "import":
        run = foreign_run(work)
        before, start = rss_kb(), time.perf_counter()
        write_foreign_run(run, ckpt_root, overwrite=True)
        return {"s": time.perf_counter() - start, "rss0": before,
                "bytes": sum(math.prod(t.shape) * 4 for t in run.tensors.values())}
    if role == "hf":
        from ms_llm.checkpoint.interop.hf import export_hf
        before, start = rss_kb(), time.perf_counter()
        out = export_hf(ckpt_root, export)
        return {"s": time.perf_counter() - start, "rss0": before, "bytes": _size(out)}
    from ms_llm.checkpoint.interop.peers import peer_module
    module = peer_module(fmt)
    if role == "export":
        shutil.rmtree(export, ignore_errors=True)
        with Checkpoint.open(ckpt_root) as ckpt:
            before, start = rss_kb(), time.perf_counter()
            out = module.write_run(ckpt, export, None)
            seconds = time.perf_counter() - start
        return {"s": seconds, "rss0": before, "bytes": _size(out)}
    if role == "reimport":
        config = peer_config(fmt, work)
        before, start = rss_kb(), time.perf_counter()
        run = module.read_run(export, config)
        write_foreign_run(run, work / f"reimport_{fmt}", overwrite=True)
        return {"s": time.perf_counter() - start, "rss0": before, "bytes": _size(export)}
    if role == "tool":
        return peer_tool(fmt, export, work / f"tool_{fmt}")
    raise SystemExit(f"unknown row {role!r}")


def peer_config(fmt: str, work: Path) -> Path | None:
    """What a user passes import-run as --config: for Megatron-LM the run's train script (the bench
    model as ms_llm's converter writes it; the arguments an export saves lack the model's flags)."""
    if fmt != "megatron":
        return None
    from ms_llm.convert import dump, from_job
    from ms_llm.job import job_from_dict
    meta = json.loads((work / "source.json").read_text())["model"]
    fp32 = {"param_dtype": "float32", "compute_dtype": "float32"}
    job = job_from_dict({"model": meta, "strategy": {"dp": 1, "precision": fp32}, "train": {}})
    path = work / "megatron_train.sh"
    path.write_text(dump(from_job(job, 1), "megatron").text)
    return path


def peer_tool(fmt: str, export: Path, out: Path) -> dict:
    """The peer's own conversion of its export to one full-state file, where the peer ships one."""
    if fmt == "torchtitan":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        folder = next((p.parent for p in export.rglob(".metadata")), None)
        if folder is None:
            raise SystemExit(f"not available: no DCP folder (.metadata) under {export}")
        before, start = rss_kb(), time.perf_counter()
        dcp_to_torch_save(str(folder), str(out.with_suffix(".pt")))
        return {"s": time.perf_counter() - start, "rss0": before, "bytes": _size(folder)}
    if fmt == "deepspeed":
        sys.path.insert(0, str(ROOT / ".oracles"))
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
        before, start = rss_kb(), time.perf_counter()
        convert_zero_checkpoint_to_fp32_state_dict(str(export), str(out))
        return {"s": time.perf_counter() - start, "rss0": before, "bytes": _size(export)}
    raise SystemExit(f"not available: {fmt} ships no conversion tool of its own to compare with")


def _size(path: Path) -> int:
    """Bytes of a folder's files, or of one file (MindFormers' write_run returns the file it wrote)."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_child(role: str, fmt: str, work: Path) -> dict | str:
    """One row in a fresh process: its result with the peak RSS, or why it did not run (one line)."""
    drop_cache(work)
    proc = subprocess.run([sys.executable, __file__, "--child", role, "--format", fmt, "--work", str(work)],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        return last if last.startswith("not available") else f"not available: {last}"
    return json.loads(proc.stdout.strip().splitlines()[-1])     # the result; a peer's warnings go to stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the state (weights + two Adam moments, fp32), GB")
    p.add_argument("--format", default="all", choices=("all", "ms_llm", *PEER_FORMATS),
                   help="the peer rows to run (ms_llm: the raw read, import and hf export rows only)")
    p.add_argument("--dir", default=None, help="where to write the state (default: a temporary folder in .tmp/)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        try:
            result = child(args.child, args.format, Path(args.work))
        except (MsLlmError, ImportError, NotImplementedError) as exc:
            raise SystemExit(f"not available: {type(exc).__name__}: {exc}") from None
        result["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result))
        return
    base = Path(args.dir) if args.dir else ROOT / ".tmp"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=base))
    try:
        report(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, work: Path) -> None:
    model = bench_model(args.gb)
    tensors = layout(model)
    largest = max(math.prod(s) * 4 for _, s, _ in tensors)
    (work / "source.json").write_text(json.dumps({"model": {k: getattr(model, k) for k in (
        "name", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
        "max_seq_len", "dtype")}, "tensors": tensors}))
    total = write_source(work / "source.bin", tensors)
    print(f"convert bench: hidden {model.hidden_size}, {model.num_layers} layers, vocab {model.vocab_size}; "
          f"{len(tensors)} tensors, {total / 1e6:.0f} MB fp32 (weights + exp_avg + exp_avg_sq), largest tensor "
          f"{largest / 1e6:.0f} MB; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'row':<18}{'s':>8}{'MB/s':>8}{'vs raw':>8}{'peak MB':>9}{'bound MB':>10}  bound = fixed + 2 x largest")
    rows = [("raw read", "raw", "ms_llm"), ("raw copy", "copy", "ms_llm"), ("ms_llm import", "import", "ms_llm"),
            ("hf export", "hf", "ms_llm")]
    for fmt in (PEER_FORMATS if args.format == "all" else (args.format,) if args.format != "ms_llm" else ()):
        rows += [(f"{fmt} export", "export", fmt), (f"{fmt} import", "reimport", fmt), (f"{fmt} tool", "tool", fmt)]
    raw_rate = None
    for label, role, fmt in rows:
        result = run_child(role, fmt, work)
        if isinstance(result, str):
            print(f"{label:<18}{result}")
            continue
        rate = result["bytes"] / 1e6 / result["s"]
        raw_rate = raw_rate or rate
        peak, fixed = result["peak"] * 1024 / 1e6, result["rss0"] * 1024 / 1e6     # kB (KiB) -> MB
        bound = fixed + 2 * largest / 1e6
        print(f"{label:<18}{result['s']:>8.2f}{rate:>8.0f}{rate / raw_rate:>8.2f}{peak:>9.1f}{bound:>10.1f}  "
              f"fixed {fixed:.0f} MB: {'within' if peak <= bound else 'OVER'} the bound")


if __name__ == "__main__":
    main()
