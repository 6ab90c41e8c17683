"""torchrun worker for tests/torch/test_torch_fp16.py: fp16 with loss scaling on the torch backend.

    torchrun --nproc-per-node W tests/helpers/fp16_torch_worker.py TOKENS OUT case [case ...]

Each case (a strategy, so a data-parallel engine) trains the same tiny model on the same
global batches three times: in fp32; in fp16 with dynamic loss scaling; in fp16 from a scale
of 2**20, which overflows until it has halved far enough. "engine16_s<N>" cases drive the
shared ZeRO engine directly over a model held in fp16 with an fp32 master copy (as the
MindSpore step drives it) instead of lowering a plan. Every rank writes
OUT/<case>-<run>-rank<r>.json: per step the loss, gradient norm, loss scale used, the
optimizer's step count after the step, and whether any tensor of its training state
(weights, moments, master copy) changed.
"""
from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.run import LossScaler, lr_at
from ms_llm.strategy.plan import plan as make_plan
from ms_llm.zero import zero_plan
from ms_llm.zero.engine import EngineConfig
from torch_backend.apply import apply, cross_entropy
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.model import Transformer
from torch_backend.state import training_state
from torch_backend.step import TrainStep
from torch_backend.zero import ZeroDataParallel
from torch_matrix_worker import MODEL

STEPS = 6                  # fp32 and fp16 runs
OVERFLOW_STEPS = 10        # 2**20 halves into fp16's range in 3-4 skipped steps, then trains (6-7 steps)
HUGE = 2.0 ** 20
NATIVE, SHARED = {"engine": "native"}, {"engine": "shared"}
PRECISIONS = {
    "fp32": {"param_dtype": "float32", "compute_dtype": "float32"},
    "fp16": {"param_dtype": "float16", "compute_dtype": "float16", "loss_scale": "dynamic"},
    "overflow": {"param_dtype": "float16", "compute_dtype": "float16", "loss_scale": "dynamic",
                 "initial_loss_scale": HUGE},
}

# name -> (world size, strategy)
CASES: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "ddp": (2, {"dp": 2, "zero": NATIVE}),
    "ddp_fp16_reduce": (2, {"dp": 2, "zero": NATIVE, "precision": {"grad_reduce_dtype": "float16"}}),
    "zero_redundancy": (2, {"dp": 2, "zero": {"stage": 1, **NATIVE}}),
    "fsdp2_zero2": (2, {"dp": 2, "zero": {"stage": 2, **NATIVE}}),
    "fsdp2_zero3": (2, {"dp": 2, "zero": {"stage": 3, **NATIVE}}),
    "shared_zero0": (2, {"dp": 2, "zero": SHARED}),
    "shared_zero1": (2, {"dp": 2, "zero": {"stage": 1, **SHARED}}),
    "shared_zero2": (2, {"dp": 2, "zero": {"stage": 2, **SHARED}}),
    "shared_zero3": (2, {"dp": 2, "zero": {"stage": 3, **SHARED}}),
    "engine16_s2": (2, {"dp": 2, "zero": {"stage": 2, **SHARED}}),
    "replicate_tp2": (4, {"dp": 2, "tp": 2, "zero": NATIVE}),
    "pipeline_pp2": (2, {"dp": 1, "pp": 2}),
}


def job_for(case: str, run: str):
    _, strategy = CASES[case]
    precision = {**PRECISIONS[run], **strategy.get("precision", {})}
    return job_from_dict({
        "name": f"{case}-{run}", "device": "cpu", "model": MODEL,
        "strategy": {**strategy, "precision": precision},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16,
                  "steps": OVERFLOW_STEPS if run == "overflow" else STEPS, "seed": 7,
                  "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.01, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 1}},
    })


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() != after.keys() or any(not torch.equal(before[k], after[k]) for k in before)


class Run:
    """One lowered training run: TrainStep over the plan, as the trainer runs it."""

    def __init__(self, case: str, run: str):
        self.rank = dist.get_rank()
        self.job = job_for(case, run)
        self.plan = make_plan(self.job.model, self.job.strategy, self.job.train, dist.get_world_size())
        meshes = build_meshes(self.plan.mesh, "cpu")
        self.step_fn = TrainStep(apply(lower(self.plan, Machine("cpu")), self.plan, meshes, torch.device("cpu"),
                                       self.rank))
        self.dp_rank, self.dp_size = meshes.coord("dp"), meshes.size("dp")

    def scale(self) -> float | None:
        return None if self.step_fn.loss_scale is None else self.step_fn.loss_scale.scale

    def step(self, k: int, rows: np.ndarray) -> tuple[float, float]:
        loss, norm = self.step_fn(k, torch.from_numpy(rows))
        return loss.item(), norm.item()

    def state(self) -> dict[str, torch.Tensor]:
        return {n: _local(t) for n, (_, t) in training_state(self.step_fn, self.plan, self.rank).items()}

    def optimizer_steps(self) -> int:
        dp = self.step_fn.m.dp
        if dp.name == "shared":
            return dp.engine.engine.step_count
        opt = self.step_fn.optimizer
        local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        return max((int(s["step"]) for s in local.state.values() if "step" in s), default=0)


class EngineRun:
    """The shared engine driven by hand over a model held in the run's param_dtype (fp16: an
    fp32 master copy in the engine), loss scaled by LossScaler: the MindSpore step's recipe."""
    MICRO = 2

    def __init__(self, case: str, run: str):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.job = job_for(case, run)
        plan = make_plan(self.job.model, self.job.strategy, self.job.train, self.world)
        prec = plan.strategy.precision
        self.model = Transformer(self.job.model)
        self.model.init_weights(self.job.train.seed)
        self.model.to(getattr(torch, prec.param_dtype))
        self.dp_rank, self.dp_size = self.rank, self.world
        self.dp = ZeroDataParallel(self.model, zero_plan(plan), self.rank, EngineConfig.from_job(plan.strategy,
                                                                                                 self.job.train))
        self.scaler = LossScaler.from_precision(prec)

    def scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.scale

    def step(self, k: int, rows: np.ndarray) -> tuple[float, float]:
        batch, total = torch.from_numpy(rows), 0.0
        for i, micro in enumerate(batch.chunk(self.MICRO)):
            with self.dp.no_sync() if i < self.MICRO - 1 else nullcontext():
                loss = cross_entropy(self.model(micro[:, :-1]), micro[:, 1:]) / self.MICRO
                (loss if self.scaler is None else loss * self.scaler.scale).backward()
            total += loss.item()
        norm = self.dp.step(lr_at(k, self.job.train), self.scale())
        if self.scaler is not None:
            self.scaler.update(math.isfinite(norm), k + 1)
        mean = torch.tensor([total / self.world])
        dist.all_reduce(mean)
        return mean.item(), norm

    def state(self) -> dict[str, torch.Tensor]:
        engine, out = self.dp.engine, {}
        for index, st in engine.state.items():
            for attr in ("master", "m", "v", "param_shard", "param_full"):
                if getattr(st, attr) is not None:
                    out[f"{index}.{attr}"] = getattr(st, attr).clone()
        out |= {n: p.detach().clone() for n, p in self.model.named_parameters() if p.untyped_storage().nbytes()}
        return out

    def optimizer_steps(self) -> int:
        return self.dp.engine.step_count


def record(case: str, run: str, tokens: np.ndarray) -> dict:
    r = EngineRun(case, run) if case.startswith("engine16") else Run(case, run)
    tc = r.job.train
    sampler = GlobalBatchSampler(tokens, tc.seq_len, tc.global_batch_size, tc.seed)
    out: dict[str, list] = {"losses": [], "norms": [], "scales": [], "optimizer_steps": [], "changed": []}
    before = r.state()
    for k in range(tc.steps):
        scale = r.scale()
        loss, norm = r.step(k, sampler.local_batch(k, r.dp_rank, r.dp_size))
        after = r.state()                 # also the state before the next step: nothing runs in between
        out["losses"].append(loss)
        out["norms"].append(norm if math.isfinite(norm) else str(norm))
        out["scales"].append(scale)
        out["optimizer_steps"].append(r.optimizer_steps())
        out["changed"].append(changed(before, after))
        before = after
    return out


def main(argv: list[str]) -> None:
    tokens_path, out, cases = argv[0], Path(argv[1]), argv[2:]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    tokens = load_tokens(Path(tokens_path))
    rank = dist.get_rank()
    for case in cases:
        for run in PRECISIONS:
            rec = record(case, run, tokens)
            (out / f"{case}-{run}-rank{rank}.json").write_text(json.dumps(rec))
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)      # as torchrun sets for W > 1: a world-1 run's idle OpenMP threads only spin
    main(sys.argv[1:])
