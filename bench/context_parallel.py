"""Context parallel on the torch backend: tokens/s and memory per rank, cp1 vs cp2 ring vs cp2 Ulysses.

The tiny model (configs/models/tiny.yaml, max_seq_len raised to --seq-len), fp32, SGD, one
sequence per step, the same random batches. Each row is its own torchrun launch (1 or 2 gloo
ranks on this machine's CPUs), so each peak RSS is its own. Per rank: tokens/s over the timed
steps (after one warm-up step), peak RSS, and the bytes autograd keeps for backward over one
forward (the activation memory the cost model prices; tests/torch_cp_memory_worker.py). The
ratios to cp1 are printed last.

    python bench/context_parallel.py [--seq-len 2048] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
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

    from ms_llm.config.job import job_from_dict
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.seq_len, args.steps)
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
