"""ms_llm's torch trainer step against torchtitan's FSDP on the same tiny LLaMA, dp2 on gloo, in one run.

    .venv/bin/python bench/peers.py [--repeats 6] [--steps 2]

Every side: configs/models/tiny.yaml, fp32, AdamW + clipping, the same global batch of 8 x 128
tokens from the same sampler, FSDP over 2 ranks (gloo, one thread each). ms_llm runs its own step
(torch_backend TrainStep) twice: strategy zero stage 3 on torch's FSDP2 (engine native) and on
ms_llm's shared ZeRO-3 engine. torchtitan (0.3.0, from .oracles) shards the model with its own
apply_fsdp_to_decoder, the FSDP step of its parallelize_llama, and clips with its own
clip_grad_norm_. The sides take turns a few steps at a time (order rotating) so machine noise hits
all alike; the median of the per-turn time ratios torchtitan / side is printed (>1: faster than
torchtitan).

Why not torchtitan's own trainer, or its own model: on this CPU-only machine neither starts.
- `torchrun -m torchtitan.train --module llama3 --config llama3_debugmodel` stops importing
  torchtitan.components.dataloader: "ModuleNotFoundError: No module named 'torchdata'". Past that,
  torchtitan.tools.utils.get_device_info() falls back to "cuda" when torch sees no accelerator and
  Trainer.__init__ calls torch.cuda.set_device, which a CPU build of torch fails with
  "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'" (its process group would be
  nccl, its meshes cuda).
- `torchtitan.models.llama3` (Llama3Model, parallelize_llama) imports its MoE token dispatcher,
  which imports triton: "ModuleNotFoundError: No module named 'triton'" (triton ships only with
  CUDA builds of torch).
So torchtitan's FSDP application runs on ms_llm's Transformer, seen under its Decoder's names, with
FSDP2's sum-then-divide reduction switched on (gloo has no PREMUL_SUM, which torchtitan's gradient
divide factor of 1 asks for).
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

import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
ORACLES = ROOT / ".oracles"
GLOBAL_BATCH, SEQ = 8, 128
SIDES = ("ms_llm fsdp2", "ms_llm zero3", "torchtitan")


def job_for(world: int, engine: str):
    from ms_llm.job import job_from_dict
    return job_from_dict({
        "name": "peers", "device": "cpu", "model": "tiny",
        "strategy": {"dp": world, "zero": {"stage": 3, "engine": engine},
                     "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
        "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // world, "seq_len": SEQ,
                  "steps": 1000, "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"warmup_steps": 10}},
    })


def ours(world: int, rank: int, engine: str):
    """ms_llm's own step, as its torch worker builds it."""
    import torch

    from ms_llm.machine import Machine
    from ms_llm.strategy.plan import plan as make_plan
    from torch_backend.apply import apply
    from torch_backend.lower import lower
    from torch_backend.mesh import build_meshes
    from torch_backend.step import TrainStep

    job = job_for(world, engine)
    plan = make_plan(job.model, job.strategy, job.train, world)
    step = TrainStep(apply(lower(plan, Machine("cpu")), plan, build_meshes(plan.mesh, "cpu"), torch.device("cpu"), rank))
    return lambda k, batch: step(k, batch)[0]


def torchtitan(world: int, tc, m):
    """ms_llm's Transformer (torchtitan's own model cannot be imported here, see the module
    docstring) sharded by torchtitan's apply_fsdp_to_decoder as its parallelize_llama calls it
    (fp32 MixedPrecisionPolicy, per-block fully_shard with its reshard policy, then the root, its
    gradient division turned off), its clip_grad_norm_, the same AdamW and learning rate."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.utils import clip_grad_norm_

    from bench._plain import plain_step
    from torch_backend.model import Transformer

    model = Transformer(m)
    model.init_weights(tc.seed)
    view = DecoderView(model)
    apply_fsdp_to_decoder(view, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)),
                          param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    # Its gradient divide factor of 1 makes FSDP2 reduce-scatter with PREMUL_SUM, which gloo lacks
    # ("RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"); FSDP2's own switch for such
    # backends sends SUM and divides after (by 1): the same gradients.
    for module in view.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    # torchtitan turns FSDP's gradient averaging off and scales the loss by the global token count
    # instead: a rank's mean loss over the rank count gives the same gradient.
    return plain_step(view, tc, clip=clip_grad_norm_, loss_divisor=world)


class DecoderView(nn.Module):
    """ms_llm's Transformer under the names torchtitan's Decoder uses (tok_embeddings, layers, norm,
    lm_head), which apply_fsdp_to_decoder reads; the names are plain attributes, so every
    parameter keeps one path (inner.*)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model
        for name, module in (("tok_embeddings", model.model.embed_tokens), ("layers", model.model.layers),
                             ("norm", model.model.norm), ("lm_head", model.lm_head)):
            object.__setattr__(self, name, module)
        object.__setattr__(self, "enable_weight_tying", False)

    def forward(self, tokens):
        return self.inner(tokens)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from ms_llm.data import GlobalBatchSampler, load_tokens
    from torch_backend.dist import init_distributed, shutdown

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    job = job_for(world, "native")
    runners = {"ms_llm fsdp2": ours(world, rank, "native"), "ms_llm zero3": ours(world, rank, "shared"),
               "torchtitan": torchtitan(world, job.train, job.model)}
    sampler = GlobalBatchSampler(load_tokens(Path(args.tokens)), SEQ, GLOBAL_BATCH, job.train.seed)
    batches = [torch.from_numpy(sampler.local_batch(k, rank, world)).long() for k in range(args.steps)]
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    losses: dict[str, float] = {}
    for r in range(args.repeats + 1):                 # repeat 0 warms every side up and is dropped
        for name in SIDES[r % 3:] + SIDES[:r % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            for k, batch in enumerate(batches):
                losses[name] = float(runners[name](k, batch))
            if r:
                times[name].append((time.perf_counter() - t0) / args.steps)
    if rank == 0:
        tokens = GLOBAL_BATCH * SEQ
        result = {name: {"tokens_per_s": tokens / statistics.median(times[name]), "last_loss": losses[name],
                         "ratio": statistics.median(t / o for t, o in zip(times["torchtitan"], times[name]))}
                  for name in SIDES}
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Needs torchtitan in .oracles (make oracles).")
    p.add_argument("--repeats", type=int, default=6, help="timed turns of each side (default 6)")
    p.add_argument("--steps", type=int, default=2, help="steps per turn (default 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        return worker(args)
    if not (ORACLES / "torchtitan").is_dir():
        sys.exit("peers: .oracles/ has no torchtitan; run `make oracles`")

    from ms_llm.data import build_stdlib_corpus
    from torch_backend.launch import torchrun

    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    tokens = str(build_stdlib_corpus(tmp / "bench-data", max_bytes=1_000_000))
    # .oracles last: torchtitan and its pure-Python dependencies, never in front of .venv's torch.
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(ROOT), str(ORACLES)]),
               OMP_NUM_THREADS="1")
    cmd = [*torchrun(2), __file__, "--worker", "--tokens", tokens, "--repeats", str(args.repeats),
           "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"peers: bench failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    res = json.loads(lines[0][len("RESULT "):])
    print(f"peers: model tiny, fp32, AdamW + clip, global batch {GLOBAL_BATCH} x {SEQ} tokens, FSDP dp2 on gloo "
          f"(1 thread per rank); {args.repeats} rotating turns of {args.steps} steps; median step times")
    print(f"{'side':<14} {'tokens/s':>10} {'vs torchtitan':>14} {'last loss':>10}")
    for name in SIDES:
        r = res[name]
        print(f"{name:<14} {r['tokens_per_s']:>10,.0f} {r['ratio']:>14.3f} {r['last_loss']:>10.4f}")
    print("torchtitan: its apply_fsdp_to_decoder and clip_grad_norm_ on the same model (its trainer and its "
          "Llama3Model cannot be imported on a CPU-only machine: bench/peers.py --help says why)")


if __name__ == "__main__":
    main()
