"""Context parallel on the torch backend: tokens/s and memory per rank, cp1 vs cp2 ring vs cp2 Ulysses.

The tiny model (configs/models/tiny.yaml, max_seq_len raised to --seq-len), fp32, SGD, one
sequence per step, the same random batches. Each row is its own torchrun launch (1 or 2 gloo
ranks on this machine's CPUs), so each peak RSS is its own. Per rank: tokens/s over the timed
steps (after one warm-up step), peak RSS, and the bytes autograd keeps for backward over one
forward (the activation memory the cost model prices; tests/helpers/torch_cp_memory_worker.py). The
ratios to cp1 are printed last.

--long: the longest sequence cp1 trains under a per-rank memory limit (train.memory_limit_gb:
RLIMIT_DATA in each worker, at what it holds once its model is built plus the limit),
found by bisection over `ms-llm train` runs of 2 steps (the second holds activations and
optimizer state at once), then 4x that sequence under the same limit with cp1 (must fail with
the out-of-memory line) and with cp4 ring (must train).

    python bench/context_parallel.py [--seq-len 2048] [--steps 3]
    python bench/context_parallel.py --long [--memory-limit-gb 0.25]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CASES = {"cp1": (1, {}), "cp2_ring": (2, {"cp": 2, "context_parallel": {"algorithm": "ring"}}),
         "cp2_ulysses": (2, {"cp": 2, "context_parallel": {"algorithm": "ulysses"}})}


def worker(case: str, seq_len: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from ms_llm.job import job_from_dict
    import yaml
    from ms_llm.machine import Machine
    from ms_llm.run import peak_rss_gb
    from ms_llm.strategy.plan import plan as make_plan
    from torch_backend.apply import apply, cross_entropy
    from torch_backend.lower import lower
    from torch_backend.mesh import build_meshes
    from torch_backend.step import TrainStep
    from torch_cp_memory_worker import saved_bytes

    dist.init_process_group("gloo")
    model = {**yaml.safe_load((ROOT / "configs" / "models" / "tiny.yaml").read_text()), "max_seq_len": seq_len}
    job = job_from_dict({"name": case, "device": "cpu", "model": model,
                         "strategy": {**CASES[case][1], "zero": {"engine": "native"},
                                      "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
                         "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": seq_len,
                                   "steps": steps + 1, "optimizer": {"name": "sgd", "lr": 0.1}}})
    plan = make_plan(job.model, job.strategy, job.train, dist.get_world_size())
    lowered = apply(lower(plan, Machine("cpu")), plan, build_meshes(plan.mesh, "cpu"), torch.device("cpu"),
                    dist.get_rank())
    step = TrainStep(lowered)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, job.model.vocab_size, (1, seq_len + 1), generator=gen) for _ in range(steps + 1)]
    step(0, batches[0])                                               # warm-up
    dist.barrier()
    start = time.perf_counter()
    for k in range(1, steps + 1):
        step(k, batches[k])[0].item()
    seconds = time.perf_counter() - start
    tokens, targets = step.context_share(batches[0][:, :-1], batches[0][:, 1:])
    part = lowered.parts[0]
    kept = saved_bytes(lambda: cross_entropy(part(tokens), targets), part.parameters())
    row = {"tokens_per_s": steps * seq_len / seconds, "peak_rss_gb": peak_rss_gb(), "saved_mb": kept / 2**20}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def long_run(seq_len: int, cp: int, limit_gb: float, folder: Path) -> tuple[bool, str, dict]:
    """`ms-llm train` of the tiny model at `seq_len` with cp ring over `cp` ranks under the limit:
    (trained, the launcher's last line, the last step's metrics)."""
    import yaml

    model = {**yaml.safe_load((ROOT / "configs" / "models" / "tiny.yaml").read_text()), "max_seq_len": seq_len}
    job = {"name": f"long_cp{cp}", "backend": "torch", "device": "cpu", "model": model,
           "strategy": {"cp": cp, "context_parallel": {"algorithm": "ring"},
                        "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": seq_len, "steps": 2,
                     "memory_limit_gb": limit_gb, "optimizer": {"name": "adamw", "lr": 1e-3}}}
    run = folder / f"cp{cp}_{seq_len}"
    config = folder / f"cp{cp}_{seq_len}.yaml"
    config.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
    print(f"  cp{cp} seq_len {seq_len}: {'trains' if proc.returncode == 0 else 'fails'}", file=sys.stderr, flush=True)
    metrics = run / "metrics.jsonl"
    steps = [m for m in map(json.loads, metrics.read_text().splitlines()) if "step" in m] if metrics.is_file() else []
    return proc.returncode == 0, last, steps[-1] if steps else {}


def long_sequence(limit_gb: float, grain: int) -> None:
    """cp1's longest sequence L under the limit (to `grain` tokens), then 4L with cp1 and cp4."""
    with tempfile.TemporaryDirectory(prefix="cp_long_") as tmp:
        folder = Path(tmp)
        fits, fails = 0, grain
        while long_run(fails, 1, limit_gb, folder)[0]:             # double until cp1 fails ...
            fits, fails = fails, 2 * fails
        while fails - fits > grain:                                # ... then bisect between
            mid = (fits + fails) // 2 // grain * grain
            fits, fails = (mid, fails) if long_run(mid, 1, limit_gb, folder)[0] else (fits, mid)
        if not fits:
            sys.exit(f"cp1 does not train even {grain} tokens under {limit_gb} GB; raise --memory-limit-gb")
        _, _, at_limit = long_run(fits, 1, limit_gb, folder)
        runs = {"cp1": long_run(4 * fits, 1, limit_gb, folder), "cp4 ring": long_run(4 * fits, 4, limit_gb, folder)}
    print(f"tiny model, AdamW, fp32, 1 sequence per step, 2 steps; memory limit {limit_gb} GB per rank "
          "(train.memory_limit_gb: RLIMIT_DATA for the steps, above each built worker); gloo on CPU")
    print(f"cp1: longest seq_len that trains L = {fits} (to {grain} tokens; {fails} fails): peak RSS "
          f"{at_limit['memory_gb']:.2f} GB, {at_limit['tokens_per_s']:.0f} tokens/s")
    for name, (ok, line, last) in runs.items():
        got = (f"trains: peak RSS rank 0 {last['memory_gb']:.2f} GB, {last['tokens_per_s']:.0f} tokens/s (job), "
               f"loss {last['loss']:.4f} at step 2") if ok else f"fails: {line}"
        print(f"{name} at 4L = {4 * fits}: {got}")
    if runs["cp1"][0] or not runs["cp4 ring"][0]:
        sys.exit("long-sequence run: cp4 must train 4L where cp1 cannot")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--long", action="store_true", help="4x the longest sequence cp1 trains under a memory limit")
    p.add_argument("--memory-limit-gb", type=float, default=0.25)
    p.add_argument("--grain", type=int, default=128, help="--long: tokens to which the longest sequence is found")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.seq_len, args.steps)
        return
    if args.long:
        long_sequence(args.memory_limit_gb, args.grain)
        return
    from torch_backend.launch import torchrun

    results = {}
    for case, (world, _) in CASES.items():
        cmd = [*torchrun(world), __file__, "--worker", case, "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{case}: failed\n{proc.stderr[-3000:]}")
        results[case] = json.loads(line.removeprefix("RESULT "))
    print(f"tiny model, seq_len {args.seq_len}, 1 sequence per step, {args.steps} timed steps, fp32, gloo on CPU")
    print(f"{'case':<12} {'tokens/s (job)':>15} {'peak RSS/rank GB':>17} {'saved act./rank MB':>19}")
    base = results["cp1"]
    for case, rows in results.items():
        tps = min(r["tokens_per_s"] for r in rows)            # the job moves at its slowest rank
        rss = max(r["peak_rss_gb"] for r in rows)
        act = max(r["saved_mb"] for r in rows)
        print(f"{case:<12} {tps:>15.0f} {rss:>17.2f} {act:>19.1f}")
    for case in ("cp2_ring", "cp2_ulysses"):
        rows = results[case]
        print(f"{case} / cp1: tokens/s {min(r['tokens_per_s'] for r in rows) / base[0]['tokens_per_s']:.2f}x, "
              f"saved activations per rank {max(r['saved_mb'] for r in rows) / base[0]['saved_mb']:.2f}x, "
              f"peak RSS per rank {max(r['peak_rss_gb'] for r in rows) / base[0]['peak_rss_gb']:.2f}x")


if __name__ == "__main__":
    main()
