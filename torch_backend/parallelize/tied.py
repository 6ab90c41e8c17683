"""The embedding group (Megatron-core's): multi-token prediction under pipeline parallel.

The MTP modules' stage keeps a copy of model.embed_tokens (torch_backend.pipeline.cut_chunk),
initialised as the first stage's (ms_llm.init by name). After backward each copy holds the
gradient of its own stage's lookups; summed over the group (the ranks at one position of the
stage mesh on the first stage and on the MTP stage), both hold the whole gradient, take the
same update and stay equal. The gradient norm counts the first stage's only.

This serves the engines that leave gradients on the parameters (none, FSDP2's replicate and
fully_shard): both stages shard alike, so the two local shards hold the same elements. The
shared ZeRO engine sums its own buckets (ms_llm.zero: the copy is a `tied` entry).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ms_llm.strategy.plan import ModelPlan
from ms_llm.zero.partition import EMBEDDING, embedding_groups
from torch_backend.dist import is_dtensor
from torch_backend.weights import canonical_name


@dataclass
class EmbeddingGroup:
    group: dist.ProcessGroup
    weight: nn.Parameter           # this rank's model.embed_tokens.weight
    counted: bool                  # the first stage's: counted in the gradient norm

    @torch.no_grad()
    def sum_grads(self) -> None:
        """After the data-parallel reduction: both copies get the sum of their gradients."""
        grad = self.weight.grad
        dist.all_reduce(grad.to_local() if is_dtensor(grad) else grad, group=self.group)

    @property
    def uncounted(self) -> tuple[nn.Parameter, ...]:
        """What the gradient norm leaves out on this rank."""
        return () if self.counted else (self.weight,)


def embedding_group(plan: ModelPlan, parts: list[nn.Module]) -> Optional[EmbeddingGroup]:
    """This rank's group, None where the plan keeps one embedding or the rank holds none. Every
    rank creates every group, in one order (torch.distributed requires it)."""
    rank, mine = dist.get_rank(), None
    for ranks in embedding_groups(plan.mesh, plan.embedding_stages()):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    if mine is None:
        return None
    weight = next(p for part in parts for n, p in part.named_parameters() if canonical_name(n) == EMBEDDING)
    return EmbeddingGroup(mine, weight, counted=plan.mesh.coords(rank)["pp"] == plan.params[EMBEDDING].stage)
