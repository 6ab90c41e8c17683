"""Data parallelism and ZeRO: one small interface, several engines behind it.

The trainer only ever calls, in this order:

    part = dp.wrap(part)                        once per model part, after TP / AC / compile
    with dp.sync(part, last):                   around each micro-batch's forward + backward
    dp.reduce_grads(parts)                      after the last backward of a step
    optimizer = dp.make_optimizer(params, cls, kwargs)
    dp.step(optimizer)                          instead of optimizer.step()

so an engine that reduces gradients explicitly (the shared ZeRO engine) plugs in beside the
native ones, which hook the reduction into backward:

    stage 0: DistributedDataParallel (FSDP2's `replicate` under tensor or pipeline parallelism)
    stage 1: DDP + ZeroRedundancyOptimizer (optimizer states sharded over dp)
    stage 2: FSDP2 fully_shard, parameters kept unsharded between forward and backward
    stage 3: FSDP2 fully_shard, parameters resharded after forward
"""
from __future__ import annotations

import importlib
import importlib.util
from contextlib import nullcontext
from typing import ContextManager, Iterable

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ms_llm.errors import StrategyError
from ms_llm.strategy.plan import ModelPlan
from torch_backend.mesh import Meshes
from torch_backend.parallelize.precision import DTYPES

# Module providing `SharedZero(plan, meshes) -> DataParallel`: ms_llm's own ZeRO engine.
SHARED_ENGINE = "torch_backend.zero"


class DataParallel:
    """No data parallelism (dp = 1): gradients are complete after backward."""
    name = "none"

    def wrap(self, part: nn.Module) -> nn.Module:
        return part

    def sync(self, part: nn.Module, last: bool) -> ContextManager:
        """Context for one micro-batch; `last` marks the one whose backward must reduce."""
        return nullcontext()

    def reduce_grads(self, parts: list[nn.Module]) -> None:
        """Engines that reduce inside backward have nothing left to do here."""

    def make_optimizer(self, params: Iterable[nn.Parameter], cls: type, kwargs: dict) -> torch.optim.Optimizer:
        return cls(params, **kwargs)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class DDP(DataParallel):
    """ZeRO-0: replicas all-reduce bucketed gradients during backward."""
    name = "ddp"

    def __init__(self, group, bucket_mb: float, grad_reduce_dtype: str):
        self.group, self.bucket_mb, self.grad_reduce_dtype = group, bucket_mb, grad_reduce_dtype

    def wrap(self, part: nn.Module) -> nn.Module:
        ddp = DistributedDataParallel(part, process_group=self.group, bucket_cap_mb=self.bucket_mb,
                                      gradient_as_bucket_view=True, forward_sync_buffers=False)
        if self.grad_reduce_dtype == "float16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(self.group, default_hooks.fp16_compress_hook)
        elif self.grad_reduce_dtype == "bfloat16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(self.group, default_hooks.bf16_compress_hook)
        return ddp

    def sync(self, part: nn.Module, last: bool) -> ContextManager:
        return nullcontext() if last else part.no_sync()


class ZeroOptimizer(DDP):
    """ZeRO-1: DDP reduces gradients; each rank updates its share of the parameters and
    broadcasts it (torch's ZeroRedundancyOptimizer)."""
    name = "ddp+zero_redundancy_optimizer"

    def make_optimizer(self, params, cls, kwargs):
        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, process_group=self.group, **kwargs)


class Replicate(DataParallel):
    """ZeRO-0 where DDP does not fit: DTensor (tensor-parallel) parameters, which DDP cannot take,
    and pipeline stages, whose schedules drive FSDP2-style modules' reduction but not DDP's
    bucket rebuild. FSDP2's replicate: an all-reduce per parameter group in backward."""
    name = "replicate"

    def __init__(self, mesh: DeviceMesh, mp: MixedPrecisionPolicy):
        self.mesh, self.mp = mesh, mp

    def wrap(self, part: nn.Module) -> nn.Module:
        return replicate(part, mesh=self.mesh, mp_policy=self.mp)


class FSDP(DataParallel):
    """ZeRO-2 / 3 with FSDP2: one shard group per decoder layer plus one for the rest."""
    name = "fsdp2"

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool, mp: MixedPrecisionPolicy):
        self.mesh, self.reshard, self.mp = mesh, reshard_after_forward, mp

    def wrap(self, part: nn.Module) -> nn.Module:
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=self.reshard, mp_policy=self.mp)
        return fully_shard(part, mesh=self.mesh, reshard_after_forward=self.reshard, mp_policy=self.mp)


def mixed_precision(plan: ModelPlan) -> MixedPrecisionPolicy:
    prec = plan.strategy.precision
    return MixedPrecisionPolicy(param_dtype=DTYPES[prec.param_dtype], reduce_dtype=DTYPES[prec.grad_reduce_dtype])


def shared_engine_available() -> bool:
    return importlib.util.find_spec(SHARED_ENGINE) is not None


def build_data_parallel(plan: ModelPlan, meshes: Meshes) -> DataParallel:
    """The engine strategy.zero asks for. 'auto' takes the shared engine where it exists."""
    s, zero = plan.strategy, plan.zero
    if s.dp == 1:
        return DataParallel()
    engine = s.zero.engine
    if engine == "shared" or (engine == "auto" and shared_engine_available()):
        if not shared_engine_available():
            raise StrategyError("strategy.zero.engine: 'shared' is not available in this torch backend; "
                                "use engine 'native' (DDP / ZeroRedundancyOptimizer / FSDP2)")
        return importlib.import_module(SHARED_ENGINE).SharedZero(plan, meshes)
    if s.precision.grad_reduce_dtype == "bfloat16" and meshes.world.device_type == "cpu" and zero.stage < 2:
        raise StrategyError("strategy.precision.grad_reduce_dtype: DDP's bf16 gradient compression needs "
                            "CUDA; use float32 (or float16) on CPU")
    if zero.stage == 0 or zero.group_size == 1:
        if s.tp > 1 or s.pp > 1:
            return Replicate(meshes["dp"], mixed_precision(plan))
        return DDP(meshes.group("dp"), s.zero.bucket_mb, s.precision.grad_reduce_dtype)
    if zero.stage == 1:
        if s.tp > 1:
            raise StrategyError("strategy.zero.stage: torch's native stage-1 optimizer does not take "
                                "tensor-parallel parameters; use engine 'shared', or stage 2/3 (FSDP2)")
        return ZeroOptimizer(meshes.group("dp"), s.zero.bucket_mb, s.precision.grad_reduce_dtype)
    # HSDP when shard groups are replicated: a 2-D (replicate, shard) mesh.
    mesh = meshes[("dp_replicate", "dp_shard")] if zero.replicate_size > 1 else meshes["dp_shard"]
    return FSDP(mesh, reshard_after_forward=zero.stage == 3, mp=mixed_precision(plan))
