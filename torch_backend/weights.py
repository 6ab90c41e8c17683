"""Materialize a (meta-device, possibly tensor-parallel) model part and fill its weights.

Every parameter gets the values ms_llm.init gives its canonical name, so any strategy
starts from the same model. A DTensor parameter takes the piece of the full tensor that the
plan's layout assigns to this rank (TensorLayout.shard_box); a mismatch with the piece
DTensor actually holds means the lowering disagrees with the plan, and stops here.
"""
from __future__ import annotations

import torch
from torch import nn

from ms_llm.errors import StrategyError
from ms_llm.init import init_param
from ms_llm.strategy.plan import ModelPlan
from torch_backend.dist import is_dtensor
from torch_backend.model import rotary_tables

def canonical_name(name: str) -> str:
    """Hugging Face name of a parameter of a part, also once DDP wrapped it (`module.`)."""
    return name.removeprefix("module.")


@torch.no_grad()
def materialize(part: nn.Module, plan: ModelPlan, device: torch.device, rank: int, seed: int) -> None:
    part.to_empty(device=device)
    if plan.model.tie_embeddings and part.lm_head is not None:
        part.lm_head.weight = part.model.embed_tokens.weight   # to_empty from meta unties them
    stage_rank = plan.stage_rank(rank)
    for name, p in part.named_parameters():
        full = torch.from_numpy(init_param(name, plan.params[name].shape, seed))
        if is_dtensor(p):
            offsets, sizes = plan.params[name].layout.shard_box(stage_rank)
            local = p.to_local()
            if tuple(local.shape) != tuple(sizes):
                raise StrategyError(f"{name}: the torch lowering holds a {tuple(local.shape)} shard where the plan "
                                    f"says {tuple(sizes)}; the tensor-parallel styles and the plan disagree")
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
        elif p.shape != full.shape:                 # experts, plain tensors: this rank's ep (and tp) slice
            offsets, sizes = plan.params[name].layout.shard_box(stage_rank)
            p.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
        else:
            p.copy_(full)
    for name, b in part.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()                               # the expert bias starts at zero (transformers, Megatron)
    cos, sin = rotary_tables(plan.model, device)
    part.rope_cos.copy_(cos)
    part.rope_sin.copy_(sin)
