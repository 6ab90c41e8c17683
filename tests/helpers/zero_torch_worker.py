"""torchrun worker for tests/torch/test_zero_torch.py: trains a small LLaMA under the shared ZeRO
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

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ms_llm.checkpoint.zero_state import engine_slices
from ms_llm.config.model import ModelConfig
from ms_llm.config.train import OptimizerConfig
from ms_llm.strategy.plan import plan
from ms_llm.zero import zero_plan
from ms_llm.zero.engine import EngineConfig
from torch_backend.model import Transformer

from zero_cases import MICRO, MODEL, GLOBAL_BATCH, batches, case_name, strategy_for, train_config


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference(opt: OptimizerConfig, config: ModelConfig = MODEL) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, torch.optim: what data parallel must equal."""
    model = Transformer(config)
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


def build(rank: int, world: int, stage: int, opt_name: str, shard: int = -1, dtype: str = "float32",
          offload: bool = False, seed: int = 1):
    from torch_backend.zero import ZeroDataParallel
    train = train_config(world, opt_name)
    mplan = plan(MODEL, strategy_for(world, stage, shard, dtype, offload), train, world)
    model = Transformer(MODEL)
    model.init_weights(seed + rank)      # replicas start different: the engine must broadcast rank 0's
    model.to(getattr(torch, dtype))
    dp = ZeroDataParallel(model, zero_plan(mplan), rank, EngineConfig.from_job(mplan.strategy, train))
    return model, dp, train


def train_steps(rank: int, world: int, model, dp, lr: float, steps: np.ndarray) -> tuple[list[float], dict]:
    per_rank = GLOBAL_BATCH // world
    losses, state_bytes = [], {}
    for step in steps:
        local = torch.from_numpy(step[rank * per_rank:(rank + 1) * per_rank])
        total = 0.0
        for i, micro in enumerate(local.chunk(MICRO)):
            with dp.no_sync() if i < MICRO - 1 else nullcontext():
                loss = loss_of(model, micro) / MICRO
                loss.backward()
            total += loss.item()
        state_bytes = dp.model_state_bytes()
        dp.step(lr)
        mean = torch.tensor([total / world])
        torch.distributed.all_reduce(mean)
        losses.append(mean.item())
    return losses, state_bytes


def full_params(model, dp) -> dict[str, torch.Tensor]:
    if dp.engine.gather is not None:
        dp.engine.gather.gather_all()
    return {n: p.detach().float().contiguous().clone() for n, p in model.named_parameters()}


def run_case(rank: int, world: int, stage: int, opt_name: str, shard: int, dtype: str, offload: bool,
             out: Path) -> None:
    model, dp, train = build(rank, world, stage, opt_name, shard, dtype, offload)
    losses, state_bytes = train_steps(rank, world, model, dp, train.optimizer.lr, batches())
    gather = dp.engine.gather
    gathers = {"gathers": gather.gathers, "peak_live": gather.peak_live} if gather is not None else {}
    params = full_params(model, dp)
    name = case_name(f"{stage}:{opt_name}:{shard}:{dtype}:{int(offload)}")
    if rank == 0:
        save_file(params, out / f"{name}.safetensors")
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, **gathers}))
    (out / f"{name}.bytes{rank}.json").write_text(json.dumps(state_bytes))
    dp.remove_hooks()


def run_resume(rank: int, world: int, stage: int, opt_name: str, out: Path) -> None:
    """Train two steps, keep only what a checkpoint keeps (model weights where they rest, the
    engine's segments cut into checkpoint pieces by ms_llm.checkpoint.zero_state, the step
    count), rebuild everything from other weights, load, train the third step."""
    model, dp, train = build(rank, world, stage, opt_name)
    mplan = plan(MODEL, strategy_for(world, stage), train, world)
    train_steps(rank, world, model, dp, train.optimizer.lr, batches()[:2])
    engine = dp.engine
    slices = engine_slices(engine, mplan, rank)

    def segment(e, s):
        return getattr(e.state[s.bucket], s.attr).narrow(0, s.start, s.numel)
    states = {name: segment(engine, s).clone() for name, s in slices.items()}
    # Under ZeRO-3 the sharded weights rest in the engine; the model holds none of them.
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.untyped_storage().nbytes()}
    step = engine.step_count
    dp.remove_hooks()
    model, dp, train = build(rank, world, stage, opt_name, seed=99)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in weights:
                p.copy_(weights[n])
        for name, s in engine_slices(dp.engine, mplan, rank).items():
            segment(dp.engine, s).copy_(states[name])
    dp.engine.step_count = step
    train_steps(rank, world, model, dp, train.optimizer.lr, batches()[2:])
    params = full_params(model, dp)
    if rank == 0:
        save_file(params, out / f"resume_s{stage}_{opt_name}.safetensors")
    shapes = {name: list(s.piece.local_shape) for name, s in slices.items()}
    (out / f"resume_s{stage}_{opt_name}.shapes{rank}.json").write_text(json.dumps(shapes))
    dp.remove_hooks()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="stage:optimizer:shard:dtype:offload,...")
    ap.add_argument("--resume", default="", help="stage:optimizer,...: save after 2 steps, reload, step 3")
    args = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = Path(args.out)
    for case in args.cases.split(","):
        stage, opt, shard, dtype, offload = case.split(":")
        run_case(rank, world, int(stage), opt, int(shard), dtype, offload == "1", out)
    for case in filter(None, args.resume.split(",")):
        stage, opt = case.split(":")
        run_resume(rank, world, int(stage), opt, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
