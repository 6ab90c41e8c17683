"""Expert parallelism on gloo: tokens/s of tiny_moe at ep1, ep2 and ep4 (4 ranks, dp 4, shared ZeRO-0),
and where an MoE layer's time goes: the all-to-all dispatch and combine (forward and backward)
against the experts' matmuls (forward and backward).

One torchrun launch runs the three settings in turn on the same batches; each times `--steps`
training steps after 2 warm-up steps. At ep1 every rank holds all 8 experts and sends nothing; at
ep4 each holds 2 and exchanges 3/4 of its routed token copies.

    python bench/moe.py [--steps 8] [--seq 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

import torch_backend.moe as moe  # noqa: E402
from ms_llm.data import GlobalBatchSampler, build_stdlib_corpus, load_tokens  # noqa: E402
from ms_llm.job import job_from_dict  # noqa: E402
from ms_llm.machine import Machine  # noqa: E402
from ms_llm.strategy.plan import plan as make_plan  # noqa: E402
from torch_backend.apply import apply  # noqa: E402
from torch_backend.dist import init_distributed, shutdown  # noqa: E402
from torch_backend.launch import torchrun  # noqa: E402
from torch_backend.lower import lower  # noqa: E402
from torch_backend.mesh import build_meshes  # noqa: E402
from torch_backend.step import TrainStep  # noqa: E402

WORLD, GLOBAL_BATCH, EPS = 4, 16, (1, 2, 4)
TIMES = {"all_to_all": 0.0, "experts": 0.0}


class _Mark(torch.autograd.Function):
    """Identity; in backward, adds (now - the time `start` recorded) to TIMES[key] (end mark) or
    records the time (start mark). Brackets the experts' backward between two marks."""

    @staticmethod
    def forward(ctx, x, mark, box):
        ctx.mark, ctx.box = mark, box
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.mark == "start":
            ctx.box["t"] = time.perf_counter()
        else:
            TIMES["experts"] += time.perf_counter() - ctx.box["t"]
        return grad, None, None


def instrument() -> None:
    """Time every all_to_all_single of the MoE layer, and the experts' forward and backward."""
    raw_all_to_all, raw_experts = dist.all_to_all_single, moe.Experts.forward

    def all_to_all_single(*args, **kwargs):
        t = time.perf_counter()
        out = raw_all_to_all(*args, **kwargs)
        TIMES["all_to_all"] += time.perf_counter() - t
        return out

    def experts(self, rows, counts):
        box: dict = {}
        rows = _Mark.apply(rows, "end", box)
        t = time.perf_counter()
        out = raw_experts(self, rows, counts)
        TIMES["experts"] += time.perf_counter() - t
        return _Mark.apply(out, "start", box)

    moe.dist.all_to_all_single = all_to_all_single
    moe.Experts.forward = experts


def measure(ep: int, steps: int, seq: int, tokens_path: str) -> dict:
    model = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
    job = job_from_dict({
        "name": f"moe_ep{ep}", "device": "cpu", "model": model,
        "strategy": {"dp": WORLD, "ep": ep, "zero": {"engine": "shared"},
                     "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // WORLD, "seq_len": seq,
                  "steps": steps + 2, "seed": 7, "optimizer": {"name": "adamw", "lr": 1e-3}},
    })
    plan = make_plan(job.model, job.strategy, job.train, WORLD)
    low = lower(plan, Machine("cpu"))
    lowered = apply(low, plan, build_meshes(plan.mesh, "cpu", low.expert_mesh), torch.device("cpu"), dist.get_rank())
    step = TrainStep(lowered)
    sampler = GlobalBatchSampler(load_tokens(Path(tokens_path)), seq, GLOBAL_BATCH, 7)
    rank = dist.get_rank()
    batches = [torch.from_numpy(sampler.local_batch(k, rank, WORLD)) for k in range(steps + 2)]
    for k in range(2):
        step(k, batches[k])[0].item()
    dist.barrier()
    TIMES.update(all_to_all=0.0, experts=0.0)
    t = time.perf_counter()
    for k in range(2, steps + 2):
        step(k, batches[k])[0].item()
    dist.barrier()
    wall = time.perf_counter() - t
    parts = torch.tensor([TIMES["all_to_all"], TIMES["experts"]])
    dist.all_reduce(parts)
    return {"ep": ep, "tokens_per_s": steps * GLOBAL_BATCH * seq / wall, "step_ms": 1e3 * wall / steps,
            "all_to_all_ms": 1e3 * parts[0].item() / WORLD / steps, "experts_ms": 1e3 * parts[1].item() / WORLD / steps}


def worker(args) -> None:
    init_distributed()
    torch.set_num_threads(1)
    instrument()
    rows = [measure(ep, args.steps, args.seq, args.tokens) for ep in EPS]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per setting")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    tokens = str(build_stdlib_corpus(tmp / "bench-data", max_bytes=1_000_000))
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [*torchrun(WORLD), __file__, "--worker", "--tokens", tokens, "--steps", str(args.steps), "--seq", str(args.seq)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"bench failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = json.loads(lines[0][len("RESULT "):])
    base = rows[0]["tokens_per_s"]
    print(f"moe: tiny_moe (8 experts, top-2, 2 MoE layers), {WORLD} gloo ranks x 1 thread, dp {WORLD}, global batch "
          f"{GLOBAL_BATCH} x seq {args.seq}, AdamW, fp32; {args.steps} timed steps per row; per-rank ms per step")
    print(f"{'setting':<8} {'tokens/s':>9} {'vs ep1':>7} {'step ms':>8} {'all-to-all ms':>14} {'experts ms':>11} "
          f"{'a2a/experts':>12}")
    for r in rows:
        ratio = r["all_to_all_ms"] / r["experts_ms"] if r["experts_ms"] else float("nan")
        print(f"ep{r['ep']:<6} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>7.2f} {r['step_ms']:>8.1f} "
              f"{r['all_to_all_ms']:>14.2f} {r['experts_ms']:>11.2f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
