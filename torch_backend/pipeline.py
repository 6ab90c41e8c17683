"""Pipeline parallelism with torch.distributed.pipelining, cut along the plan's chunks.

A stage module is the whole model with the other chunks' parts deleted (the model's
forward skips None modules). Chunk i of the plan is pipeline stage i; the plan already
placed chunks on ranks the way each schedule expects (looped: i % pp; V: down and back up).
torch.distributed.pipelining is imported by build_schedule only: it pulls in torch._dynamo,
half a second of every worker's start that a job without pipeline parallelism never uses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ms_llm.config.model import ModelConfig
from ms_llm.strategy.plan import ChunkPlan
from torch_backend.lower import TorchLowering
from torch_backend.model import Transformer

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

def cut_chunk(cfg: ModelConfig, chunk: ChunkPlan) -> Transformer:
    """The model (built on the current default device, meta normally) reduced to one chunk. The
    chunk of the MTP modules keeps model.embed_tokens for them when it is not the first: a copy,
    initialised as the first chunk's, whose gradient the embedding group sums with the first's
    (torch_backend.parallelize.tied, Megatron-core's embedding group), so the two stay equal. It
    looks up the targets (token i + 1 at position i): no tokens travel between stages."""
    model = Transformer(cfg)
    model.takes_tokens = chunk.has_embedding
    if not chunk.has_embedding and not chunk.has_mtp:
        model.model.embed_tokens = None
    if not chunk.has_head:
        model.model.norm = None
        model.lm_head = None
    if not chunk.has_mtp:          # the MTP modules sit beside lm_head
        model.model.mtp = None
    for key in list(model.model.layers.keys()):
        if int(key) not in chunk.layers:
            del model.model.layers[key]
    return model


def build_schedule(low: TorchLowering, parts: list[nn.Module], chunks: tuple[ChunkPlan, ...], group,
                   device: torch.device, loss_fn) -> _PipelineSchedule:
    """The lowering's schedule over this rank's `parts` (one per chunk of `chunks`). It leaves the
    gradients as backward made them (scale_grads off): TrainStep weights each micro-batch's loss
    by 1/micro_batches instead, which also reaches gradients an engine already took out of autograd."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    n_stages = sum(len(stage) for stage in low.stages)
    stages = [PipelineStage(part, chunk.index, n_stages, device, group=group) for part, chunk in zip(parts, chunks)]
    cls: type[_PipelineSchedule] = getattr(pipelining, low.schedule)      # e.g. Schedule1F1B
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=low.micro_batches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=low.micro_batches, loss_fn=loss_fn, scale_grads=False)
