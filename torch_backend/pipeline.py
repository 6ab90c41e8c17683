"""Pipeline parallelism with torch.distributed.pipelining, cut along plan.chunks.

A stage module is the whole model with the other chunks' parts deleted (the model's
forward skips None modules). Chunk i of the plan is pipeline stage i; the plan already
placed chunks on ranks the way each schedule expects (looped: i % pp; V: down and back up).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule

from ms_llm.config.model import ModelConfig
from ms_llm.strategy.plan import ChunkPlan, ModelPlan
from torch_backend.model import Transformer

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def cut_chunk(cfg: ModelConfig, chunk: ChunkPlan) -> Transformer:
    """The model (built on the current default device, meta normally) reduced to one chunk."""
    model = Transformer(cfg)
    if not chunk.has_embedding:
        model.model.embed_tokens = None
    if not chunk.has_head:
        model.model.norm = None
        model.lm_head = None
    for key in list(model.model.layers.keys()):
        if int(key) not in chunk.layers:
            del model.model.layers[key]
    return model


def build_schedule(plan: ModelPlan, parts: list[nn.Module], chunks: tuple[ChunkPlan, ...], group,
                   device: torch.device, loss_fn) -> _PipelineSchedule:
    stages = [PipelineStage(part, chunk.index, len(plan.chunks), device, group=group)
              for part, chunk in zip(parts, chunks)]
    cls = SCHEDULES[plan.strategy.pipeline.schedule]
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=plan.micro_batches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=plan.micro_batches, loss_fn=loss_fn)
