"""Overhead of the ms_llm torch trainer step over a plain hand-written torch loop.

Same model (configs/models/tiny.yaml), batches, AdamW, gradient clipping and threads; fp32.
The two alternate in one process (repeat r: K steps of one, then K of the other, order
flipping each repeat); the median of the per-repeat time ratios is printed, of wall time and
of rank 0's CPU time (all its threads', gloo's included: on a loaded machine the steadier of
the two). The dp2 rows run the same comparison under torchrun on 2 ranks (plain loop:
DistributedDataParallel), once with the trainer on torch's DDP (engine native) and once on
ms_llm's ZeRO engine (engine shared, stage 0: the same all-reduce data parallelism).

    python bench/torch_overhead.py [--repeats 15] [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from bench._plain import plain_step  # noqa: E402
from ms_llm.data import GlobalBatchSampler, build_stdlib_corpus, load_tokens  # noqa: E402
from ms_llm.job import job_from_dict  # noqa: E402
from ms_llm.machine import Machine  # noqa: E402
from ms_llm.strategy.plan import plan as make_plan  # noqa: E402
from torch_backend.apply import apply  # noqa: E402
from torch_backend.dist import init_distributed, shutdown  # noqa: E402
from torch_backend.launch import torchrun  # noqa: E402
from torch_backend.lower import lower  # noqa: E402
from torch_backend.mesh import build_meshes  # noqa: E402
from torch_backend.model import Transformer  # noqa: E402
from torch_backend.step import TrainStep  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 128


def job_for(world: int, engine: str):
    return job_from_dict({
        "name": "bench", "device": "cpu", "model": "tiny",
        "strategy": {"dp": world, "zero": {"engine": engine},
                     "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // world, "seq_len": SEQ,
                  "steps": 1000, "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"warmup_steps": 10}},
    })


def plain_step_fn(job, world: int):
    """The loop anyone would write: model, DDP when distributed, AdamW, clip, step."""
    model = Transformer(job.model)
    model.init_weights(job.train.seed)
    return plain_step(DistributedDataParallel(model) if world > 1 else model, job.train)


def measure(repeats: int, steps: int, tokens_path: str, engine: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    job = job_for(world, engine)
    plan = make_plan(job.model, job.strategy, job.train, world)
    meshes = build_meshes(plan.mesh, "cpu")
    ours = TrainStep(apply(lower(plan, Machine("cpu")), plan, meshes, torch.device("cpu"), rank))
    plain = plain_step_fn(job, world)
    sampler = GlobalBatchSampler(load_tokens(Path(tokens_path)), SEQ, GLOBAL_BATCH, job.train.seed)
    batches = [torch.from_numpy(sampler.local_batch(k, rank, world)) for k in range(steps)]
    runners = {"ms_llm": lambda k, b: ours(k, b)[0], "plain": plain}
    times: dict[str, list[float]] = {"ms_llm": [], "plain": []}
    cpu: dict[str, list[float]] = {"ms_llm": [], "plain": []}
    for r in range(repeats + 1):                      # repeat 0 warms both up and is dropped
        order = ["ms_llm", "plain"] if r % 2 == 0 else ["plain", "ms_llm"]
        for name in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for k, batch in enumerate(batches):
                runners[name](k, batch).item()
            if r:
                times[name].append((time.perf_counter() - t0) / steps)
                cpu[name].append((time.process_time() - c0) / steps)
    # Each repeat pairs adjacent blocks of the two, so load that drifts over the run cancels.
    ratios = [a / b for a, b in zip(times["ms_llm"], times["plain"])]
    cpu_ratios = [a / b for a, b in zip(cpu["ms_llm"], cpu["plain"])]
    return {"world": world, "engine": ours.m.dp.name, "threads": torch.get_num_threads(),
            "ms_llm": statistics.median(times["ms_llm"]), "plain": statistics.median(times["plain"]),
            "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios)}


def worker(args) -> None:
    init_distributed()
    result = measure(args.repeats, args.steps, args.tokens, args.engine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=2, help="steps per timed block")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the single process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", default="native", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    tokens = str(build_stdlib_corpus(tmp / "bench-data", max_bytes=1_000_000))
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    rows = []
    for world, engine in ((1, "native"), (2, "native"), (2, "shared")):
        env["OMP_NUM_THREADS"] = str(args.threads if world == 1 else 1)
        cmd = [*torchrun(world), __file__, "--worker", "--tokens", tokens, "--engine", engine,
               "--repeats", str(args.repeats), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            sys.exit(f"bench failed (world {world}, {engine}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        rows.append(json.loads(lines[0][len("RESULT "):]))

    print(f"torch_overhead: model tiny, seq {SEQ}, global batch {GLOBAL_BATCH}, AdamW + clip, fp32; "
          f"{args.repeats} interleaved pairs of {args.steps}-step blocks: median step times, "
          f"median paired ratio (wall; rank 0's CPU)")
    print(f"{'setting':<18} {'threads/rank':>12} {'ms_llm ms/step':>15} {'plain ms/step':>14} {'ratio':>7} "
          f"{'cpu ratio':>9}")
    for row in rows:
        name = "1 process" if row["world"] == 1 else f"dp{row['world']} ({row['engine']})"
        print(f"{name:<18} {row['threads']:>12} {1e3 * row['ms_llm']:>15.1f} {1e3 * row['plain']:>14.1f} "
              f"{row['ratio']:>7.3f} {row['cpu_ratio']:>9.3f}")


if __name__ == "__main__":
    main()
