"""ms_llm's torch backend against a plain FSDP2 loop on one GPU: a 1B-8B LLaMA in bf16, tokens/s and MFU, in one run.

    .venv/bin/python bench/gpu_mfu.py [--model llama3_1b] [--seq 4096] [--batch 2] [--recompute none]
    .venv/bin/python bench/gpu_mfu.py --model llama3_8b --device h200 --batch 1 --recompute full

Both sides train the same model (same initial weights, same random batches) with bf16 compute,
fp32 master weights and reductions, AdamW and gradient clipping: ms_llm through its own step
(torch_backend TrainStep, strategy dp1 with bfloat16 params / bfloat16 compute / float32 master),
the plain loop as anyone would write it with FSDP2 (fully_shard per decoder layer, then the root,
MixedPrecisionPolicy(bf16 params, fp32 reduce)) on a one-GPU mesh. One process runs the plain loop,
frees it, then ms_llm (a model that fits the GPU once need not fit twice); each side runs one
warm-up turn and then timed turns of a few steps, and the median turn is its step time. MFU =
tokens/s x the model's training FLOPs per token (ms_llm.config.ModelConfig.flops_per_token) / the
GPU's dense bf16 peak (ms_llm.strategy.devices).

With --recompute full both sides keep only each decoder layer's input (ms_llm: strategy recompute
full; the plain loop: torch's composable checkpoint on each layer, before fully_shard). The cost
model checks that the model fits the GPU before anything touches it (an 8B model with fp32 master
weights and AdamW states needs ~130 GB: an H200 with full recompute, not an H100). Without a CUDA
device the bench says so in one line and measures nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# LLaMA-3.2-1B's shape (ms_llm ships no 1B config).
LLAMA3_1B = {"name": "llama3_1b", "vocab_size": 128256, "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
             "num_kv_heads": 8, "ffn_hidden_size": 8192, "max_seq_len": 8192, "rope_theta": 500000.0}
GPUS = {"H100": "h100", "H200": "h200", "A100": "a100"}       # torch.cuda.get_device_name -> ms_llm device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_1b",
                   help="llama3_1b (built in) or a name in configs/models / a model YAML, 1B-8B (default llama3_1b)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--steps", type=int, default=5, help="steps per turn (default 5)")
    p.add_argument("--repeats", type=int, default=4, help="timed turns of each side, after one warm-up turn (default 4)")
    p.add_argument("--recompute", choices=("none", "full"), default="none",
                   help="activation recompute on both sides (default none)")
    p.add_argument("--device", choices=sorted(set(GPUS.values())), default=None,
                   help="the GPU's peak FLOP/s and memory for MFU and the fit check; default: from its name")
    args = p.parse_args(argv)
    for flag in ("seq", "batch", "steps", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: got {getattr(args, flag)}; need at least 1")
    return args


def job_for(args: argparse.Namespace, device: str):
    """The ms_llm job of the run; a model outside 1B-8B, a sequence longer than the model's, or a
    model that does not fit the device is one line naming the flag."""
    from ms_llm.job import job_from_dict
    from ms_llm.errors import ConfigError
    from ms_llm.strategy.cost import estimate
    from ms_llm.strategy.devices import get_device
    from ms_llm.strategy.plan import plan

    job = job_from_dict({
        "name": "gpu_mfu", "device": device, "model": LLAMA3_1B if args.model == "llama3_1b" else args.model,
        "strategy": {"dp": 1, "recompute": {"policy": args.recompute}, "precision": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16",
                                            "master_dtype": "float32"}},
        "train": {"global_batch_size": args.batch, "micro_batch_size": args.batch, "seq_len": args.seq,
                  "steps": 1000, "optimizer": {"name": "adamw", "lr": 1e-4, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 10}}})
    billions = job.model.num_params() / 1e9
    if not 0.9 <= billions <= 8.5:
        raise ConfigError(f"--model: {job.model.name} has {billions:.1f}B parameters; this bench is for 1B-8B models")
    if args.seq > job.model.max_seq_len:
        raise ConfigError(f"--seq: {args.seq} exceeds {job.model.name}'s max_seq_len {job.model.max_seq_len}")
    spec = get_device(device)
    need = estimate(plan(job.model, job.strategy, job.train, 1), spec).memory.total
    if need > spec.memory_bytes:
        raise ConfigError(f"--model/--seq/--batch/--recompute: {job.model.name} needs ~{need / 1e9:.0f} GB by ms_llm's cost model, "
                          f"more than one {spec.memory_bytes / 1e9:.0f} GB {device}; pick a smaller model, --seq or "
                          "--batch, or --recompute full")
    return job


def plain_fsdp2(job, device):
    """The loop anyone would write: the model in fp32, FSDP2 with bf16 compute, AdamW, clip."""
    import torch
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from bench._plain import plain_step
    from torch_backend.model import Transformer

    tc = job.train
    model = Transformer(job.model)
    model.init_weights(tc.seed)
    model.to(device)
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers.values():
        if job.strategy.recompute.policy == "full":
            checkpoint(layer, preserve_rng_state=False)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return plain_step(model, tc)


def ms_llm_step(job, device):
    """ms_llm's step, built as its torch worker builds it."""
    from ms_llm.machine import Machine
    from ms_llm.strategy.plan import plan as make_plan
    from torch_backend.apply import apply
    from torch_backend.lower import lower
    from torch_backend.mesh import build_meshes
    from torch_backend.step import TrainStep

    plan = make_plan(job.model, job.strategy, job.train, 1)
    low = lower(plan, Machine("cuda"))
    step = TrainStep(apply(low, plan, build_meshes(low.mesh, "cuda"), device, 0))
    return lambda k, batch: step(k, batch)[0]


def measure(job, args) -> dict[str, dict[str, float]]:
    import gc

    import torch

    from ms_llm.strategy.devices import get_device
    from torch_backend.dist import init_distributed, shutdown

    device = init_distributed()                         # a world of one: NCCL on this GPU
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, job.model.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
               for _ in range(args.steps)]
    tokens = args.batch * args.seq
    flops = job.model.flops_per_token(args.seq) * tokens
    peak = get_device(job.device).peak_flops
    out = {}
    for name, build in (("plain FSDP2", plain_fsdp2), ("ms_llm", ms_llm_step)):
        step = build(job, device)
        torch.cuda.reset_peak_memory_stats(device)
        turns = []
        for r in range(args.repeats + 1):               # turn 0 warms up (allocator, kernels) and is dropped
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k, batch in enumerate(batches):
                loss = step(k, batch)
            loss.item()                                 # waits for the turn's last step
            if r:
                turns.append((time.perf_counter() - t0) / args.steps)
        seconds = statistics.median(turns)
        out[name] = {"tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak, "loss": loss.item(),
                     "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
        del step, loss
        gc.collect()
        torch.cuda.empty_cache()
    shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from ms_llm.errors import MsLlmError
    try:                            # checked here too without a GPU: against --device, else an H100
        job = job_for(args, args.device or "h100")
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        device = args.device or next((key for tag, key in GPUS.items() if name and tag in name), None)
        if name is not None and device is None:
            raise MsLlmError(f"--device: cannot tell the peak FLOP/s of {name!r}; pass --device h100, h200 or a100")
        if device is not None and device != job.device:
            job = job_for(args, device)
    except MsLlmError as exc:
        print(f"gpu_mfu: error: {exc}", file=sys.stderr)
        return 2
    if name is None:
        print("gpu_mfu: not run: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "run it where an NVIDIA GPU and a CUDA build of torch are")
        return 0
    res = measure(job, args)
    print(f"gpu_mfu: {job.model.name} ({job.model.num_params() / 1e9:.2f}B params) on one {name}, bf16 compute / "
          f"fp32 master, batch {args.batch} x {args.seq} tokens, recompute {args.recompute}, AdamW + clip; "
          f"{args.repeats} turns of {args.steps} steps each, median turn")
    base = res["plain FSDP2"]["tokens_per_s"]
    print(f"{'side':<12} {'tokens/s':>10} {'MFU':>7} {'vs plain FSDP2':>15} {'peak GiB':>9} {'last loss':>10}")
    for side in ("ms_llm", "plain FSDP2"):
        r = res[side]
        print(f"{side:<12} {r['tokens_per_s']:>10,.0f} {100 * r['mfu']:>6.1f}% {r['tokens_per_s'] / base:>15.3f} "
              f"{r['memory_gib']:>9.1f} {r['loss']:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
