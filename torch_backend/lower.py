"""ModelPlan -> this rank's runnable model: pipeline chunks, parallelized and wrapped.

Reads the plan and nothing else about the strategy. What the torch backend can run, and
with which data-parallel engine, is torch_backend.support's answer (the launcher asked it
before torchrun started); lower() asks again, before any memory is allocated.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ms_llm.machine import Machine
from ms_llm.strategy.plan import ChunkPlan, ModelPlan
from torch_backend import support
from torch_backend.mesh import Meshes
from torch_backend.parallelize import parallelize
from torch_backend.parallelize.dp import DataParallel, build_data_parallel
from torch_backend.parallelize.precision import autocast
from torch_backend.pipeline import build_schedule, cut_chunk


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Mean next-token loss times `scale` (fp16 loss scaling inside a pipeline schedule, which
    computes the loss itself); logits (B, T, V), possibly vocab-sharded under loss_parallel."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1)) * scale


def local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Lowered:
    plan: ModelPlan
    meshes: Meshes
    device: torch.device
    chunks: tuple[ChunkPlan, ...]      # this rank's chunks, in virtual order
    parts: list[nn.Module]             # one wrapped module per chunk
    dp: DataParallel
    schedule: Optional[object]         # a torch.distributed.pipelining schedule when pp > 1

    @property
    def has_first(self) -> bool:
        return any(c.has_embedding for c in self.chunks)

    @property
    def has_last(self) -> bool:
        return any(c.has_head for c in self.chunks)

    def loss_context(self) -> ContextManager:
        """Vocab-parallel cross entropy over the tp-sharded logits (forward and backward)."""
        return loss_parallel() if self.plan.strategy.tp > 1 else nullcontext()

    def autocast(self) -> ContextManager:
        return autocast(self.plan, self.device.type)


def lower(plan: ModelPlan, meshes: Meshes, device: torch.device, rank: int, compile: bool = False) -> Lowered:
    machine = Machine("cuda" if device.type == "cuda" else "cpu")
    support.check(plan, machine)
    chunks = plan.chunks_of_stage(meshes.coord("pp"))
    dp = build_data_parallel(plan, meshes, device, support.zero_engine(plan, machine))
    with torch.device("meta"):
        parts = [cut_chunk(plan.model, chunk) for chunk in chunks]
    parts = parallelize(parts, plan, meshes, dp, device, rank, plan.train.seed, compile)
    schedule = None
    if plan.strategy.pp > 1:
        schedule = build_schedule(plan, parts, chunks, meshes.group("pp"), device, cross_entropy)
    return Lowered(plan, meshes, device, chunks, parts, dp, schedule)
