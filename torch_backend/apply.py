"""TorchLowering -> this rank's runnable model: pipeline chunks, parallelized and wrapped.

What to build is the lowering's (torch_backend.lower, pure data); this module only builds it:
the chunks of this pipeline rank on the meta device, then torch_backend.parallelize in its
fixed order, then the pipeline schedule.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ms_llm.strategy.plan import ChunkPlan, ModelPlan
from torch_backend.dist import is_dtensor
from torch_backend.lower import TorchLowering
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
    return t.full_tensor() if is_dtensor(t) else t


@dataclass
class Lowered:
    plan: ModelPlan
    lowering: TorchLowering
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
        if not self.lowering.loss_parallel:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()

    def autocast(self) -> ContextManager:
        return autocast(self.lowering.compute_dtype, self.device.type)


def apply(low: TorchLowering, plan: ModelPlan, meshes: Meshes, device: torch.device, rank: int) -> Lowered:
    """Build this rank's share of `low` (lowered from `plan`) on `device`, over `meshes`."""
    chunks = low.stages[meshes.coord("pp")]
    dp = build_data_parallel(low.dp, plan, meshes, device)
    with torch.device("meta"):
        parts = [cut_chunk(plan.model, chunk) for chunk in chunks]
    parts = parallelize(parts, low, plan, meshes, dp, device, rank)
    schedule = None
    if low.schedule is not None:
        schedule = build_schedule(low, parts, chunks, meshes.group("pp"), device, cross_entropy)
    return Lowered(plan, low, meshes, device, chunks, parts, dp, schedule)
