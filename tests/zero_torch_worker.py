"""torchrun worker for tests/test_zero_torch.py: trains a small LLaMA under the shared ZeRO
engine for each (stage, optimizer) case and writes the final parameters, the losses and
the measured model-state bytes (rank 0 writes parameters; every rank writes its bytes).

Also importable: `reference` trains the same model in one process with torch.optim, the
plain data-parallel result every case must reproduce.
"""
from __future__ import annotations

import argparse
import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ms_llm.config.train import OptimizerConfig
from ms_llm.strategy.plan import plan
from ms_llm.zero import zero_plan
from ms_llm.zero.engine import EngineConfig
from torch_backend.model import Transformer

from zero_cases import MICRO, MODEL, GLOBAL_BATCH, batches, case_name, strategy_for, train_config


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference(opt: OptimizerConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, torch.optim: what data parallel must equal."""
    model = Transformer(MODEL)
    model.init_weights(1)
    params = list(model.parameters())
    if opt.name == "sgd":
        optim = torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    else:
        optim = torch.optim.AdamW(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    losses = []
    for step in batches():
        loss = loss_of(model, torch.from_numpy(step))
        loss.backward()
        if opt.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def run_case(rank: int, world: int, stage: int, opt_name: str, shard: int, dtype: str, offload: bool,
             out: Path) -> None:
    from torch_backend.zero import ZeroDataParallel
    strategy = strategy_for(world, stage, shard, dtype, offload)
    train = train_config(world, opt_name)
    mplan = plan(MODEL, strategy, train, world)
    model = Transformer(MODEL)
    model.init_weights(1 + rank)      # replicas start different: the engine must broadcast rank 0's
    model.to(getattr(torch, dtype))
    dp = ZeroDataParallel(model, zero_plan(mplan), rank, EngineConfig.from_job(mplan.strategy, train))
    per_rank = GLOBAL_BATCH // world
    losses, state_bytes = [], None
    for step in batches():
        local = torch.from_numpy(step[rank * per_rank:(rank + 1) * per_rank])
        total = 0.0
        for i, micro in enumerate(local.chunk(MICRO)):
            with dp.no_sync() if i < MICRO - 1 else nullcontext():
                loss = loss_of(model, micro) / MICRO
                loss.backward()
            total += loss.item()
        state_bytes = dp.model_state_bytes()
        dp.step(train.optimizer.lr)
        mean = torch.tensor([total / world])
        torch.distributed.all_reduce(mean)
        losses.append(mean.item())
    if dp.engine.gather is not None:
        dp.engine.gather.gather_all()
    name = case_name(f"{stage}:{opt_name}:{shard}:{dtype}:{int(offload)}")
    if rank == 0:
        save_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()}, out / f"{name}.safetensors")
        (out / f"{name}.json").write_text(json.dumps({"losses": losses}))
    (out / f"{name}.bytes{rank}.json").write_text(json.dumps(state_bytes))
    dp.remove_hooks()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="stage:optimizer:shard:dtype:offload,...")
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = Path(args.out)
    for case in args.cases.split(","):
        stage, opt, shard, dtype, offload = case.split(":")
        run_case(rank, world, int(stage), opt, int(shard), dtype, offload == "1", out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
