"""Shared ZeRO engine vs torch's own, side by side in one run (gloo on CPU, dp2 and dp4).

    .venv/bin/python bench/zero.py [--model tiny] [--steps 6] [--rounds 3]

Stage 1: ZeroDataParallel(stage 1) vs DDP + torch ZeroRedundancyOptimizer(AdamW).
Stage 3: ZeroDataParallel(stage 3) vs FSDP2 fully_shard (each decoder layer, then the root).
Every engine trains the same model (fp32, AdamW, no clipping) on the same batches; the
engines take turns a few steps at a time so machine noise hits all of them alike. Prints
tokens/s, the shared engine's ratio to torch's, and model-state bytes per rank (params +
grads + optimizer states held at the end of backward, rank 0) next to the cost formula,
and gloo's collectives timed on one whole-model bucket (why the engine's torch
implementation uses all-reduce and broadcasts on gloo).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = ("shared-zero1", "torch-zero1", "shared-zero3", "torch-fsdp2")


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _optim_tensors(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if hasattr(v, "dim") and v.dim() > 0]


def _collective_times(numel: int, rank: int, world: int, repeat: int = 5) -> dict[str, float]:
    """Milliseconds per collective on a bucket of `numel` fp32 elements, gloo's own forms and
    the all-reduce / broadcast forms TorchComm uses on gloo."""
    import torch
    import torch.distributed as dist

    numel -= numel % world
    buf, seg = torch.randn(numel), numel // world
    own = buf.narrow(0, rank * seg, seg)
    forms = {
        "all_reduce": lambda: dist.all_reduce(buf),
        "reduce_scatter": lambda: dist.reduce_scatter_single(own, buf),
        "all_gather": lambda: dist.all_gather_single(buf, own),
        "broadcast_segments": lambda: [dist.broadcast(buf.narrow(0, i * seg, seg), src=i) for i in range(world)],
    }
    out = {}
    for name, fn in forms.items():
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        dist.barrier()
        out[name] = (time.perf_counter() - start) / repeat * 1e3
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from ms_llm.job import load_section
    from ms_llm.config.train import OptimizerConfig, TrainConfig
    from ms_llm.strategy.ir import ParallelStrategy, PrecisionSpec, ZeroSpec
    from ms_llm.strategy.plan import plan
    from ms_llm.zero import zero_plan
    from ms_llm.zero.engine import EngineConfig
    from torch_backend.model import Transformer
    from torch_backend.zero import ZeroDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = load_section("model", args.model)
    opt = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, grad_clip=0.0)
    train = TrainConfig(global_batch_size=args.batch, micro_batch_size=args.batch // world, seq_len=args.seq,
                        optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, model_cfg.vocab_size, (args.steps * args.rounds + 2, args.batch, args.seq + 1), generator=gen)
    per = args.batch // world

    def fresh():
        m = Transformer(model_cfg)
        m.init_weights(1)
        return m

    def loss_of(m, tokens):
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    runners, measure = {}, {}
    for name in ENGINES:
        model = fresh()
        if name.startswith("shared"):
            stage = int(name[-1])
            strategy = ParallelStrategy(dp=world, zero=ZeroSpec(stage=stage),
                                        precision=PrecisionSpec(param_dtype="float32", compute_dtype="float32"))
            mplan = plan(model_cfg, strategy, train, world)
            dp = ZeroDataParallel(model, zero_plan(mplan), rank, EngineConfig.from_job(mplan.strategy, train))

            def step(tokens, model=model, dp=dp):
                loss_of(model, tokens).backward()
                measure[id(dp)] = dp.model_state_bytes()
                dp.step(opt.lr)
            runners[name] = (step, lambda dp=dp: sum(measure[id(dp)].values()), mplan)
        elif name == "torch-zero1":
            ddp = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
            zopt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=opt.lr,
                                           betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay)

            def step(tokens, ddp=ddp, zopt=zopt, model=model):
                loss_of(ddp, tokens).backward()
                measure[id(zopt)] = (_storage_bytes(p for p in model.parameters())
                                     + _storage_bytes(p.grad for p in model.parameters())
                                     + _storage_bytes(_optim_tensors(zopt.optim)))
                zopt.step()
                zopt.zero_grad(set_to_none=False)
            runners[name] = (step, lambda zopt=zopt: measure[id(zopt)], None)
        else:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            adam = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                     weight_decay=opt.weight_decay)

            def step(tokens, model=model, adam=adam):
                loss_of(model, tokens).backward()
                measure[id(adam)] = (_storage_bytes(p for p in model.parameters())
                                     + _storage_bytes(p.grad for p in model.parameters())
                                     + _storage_bytes(_optim_tensors(adam)))
                adam.step()
                adam.zero_grad()
            runners[name] = (step, lambda adam=adam: measure[id(adam)], None)

    collectives = _collective_times(sum(p.numel() for p in fresh().parameters()), rank, world)
    elapsed = {name: 0.0 for name in ENGINES}
    for name in ENGINES:                                  # warm-up: first-step allocations, lazy states
        runners[name][0](data[0, rank * per:(rank + 1) * per])
    for r in range(args.rounds):
        for name in ENGINES:
            dist.barrier()
            start = time.perf_counter()
            for s in range(args.steps):
                runners[name][0](data[1 + r * args.steps + s, rank * per:(rank + 1) * per])
            dist.barrier()
            elapsed[name] += time.perf_counter() - start

    from ms_llm.strategy import cost
    tokens = args.batch * args.seq * args.steps * args.rounds
    formula = {}
    for stage in (1, 3):
        mplan = runners[f"shared-zero{stage}"][2]
        mem = cost.memory(mplan)
        formula[stage] = mem.params + mem.grads + mem.optimizer
    if rank == 0:
        result = {name: {"tokens_per_s": tokens / elapsed[name], "state_bytes": runners[name][1]()}
                  for name in ENGINES}
        result["formula"] = formula
        result["collectives"] = collectives
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=2, help="steps per turn")
    ap.add_argument("--rounds", type=int, default=8, help="turns per engine")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dp", default="2,4")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from torch_backend.launch import torchrun
    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    rows = []
    for world in (int(w) for w in args.dp.split(",")):
        with tempfile.NamedTemporaryFile(dir=tmp, suffix=".json") as f:
            cmd = [*torchrun(world), __file__, "--worker",
                   "--out", f.name, "--model", args.model, "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--batch", str(args.batch), "--seq", str(args.seq)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"bench worker failed at dp{world}:\n{proc.stderr[-3000:]}")
            rows.append((world, json.loads(Path(f.name).read_text())))
    print(f"model {args.model}, fp32 AdamW, global batch {args.batch} x {args.seq} tokens, gloo CPU, "
          f"{args.rounds} x {args.steps} steps per engine, interleaved")
    print(f"{'dp':>3} {'stage':>5} {'engine':<14} {'tokens/s':>10} {'ratio':>6} {'state MB/rank':>14} {'formula MB':>11}")
    for world, res in rows:
        for stage, ours, theirs in ((1, "shared-zero1", "torch-zero1"), (3, "shared-zero3", "torch-fsdp2")):
            base = res[theirs]["tokens_per_s"]
            for name in (ours, theirs):
                r = res[name]
                print(f"{world:>3} {stage:>5} {name:<14} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>6.2f} "
                      f"{r['state_bytes'] / 2**20:>14.3f} {res['formula'][str(stage)] / 2**20:>11.3f}")
    print("\ngloo, ms per collective on a whole-model fp32 bucket (all_reduce / broadcast_segments are what "
          "the shared engine issues on gloo for reduce_scatter / all_gather)")
    names = list(rows[0][1]["collectives"])
    print(f"{'dp':>3} " + " ".join(f"{n:>18}" for n in names))
    for world, res in rows:
        print(f"{world:>3} " + " ".join(f"{res['collectives'][n]:>18.1f}" for n in names))


if __name__ == "__main__":
    main()
