"""Activation checkpointing per decoder layer, as plan.recompute says.

full:      keep only the layer's input; recompute the whole layer in backward.
selective: keep the matmul outputs (and collectives, so TP communication is not repeated);
           recompute the cheap rest: attention core, norms, rotary, SwiGLU activation.

The composable `checkpoint` works through module hooks, so parameter names stay the
canonical ones (engines and checkpoints address parameters by name).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ms_llm.strategy.plan import ModelPlan

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(part: nn.Module, plan: ModelPlan) -> None:
    """Checkpoint each decoder layer of `part` whose plan.recompute mode is not 'none'."""
    for key, layer in part.model.layers.items():
        mode = plan.recompute[int(key)]
        if mode == "full":
            checkpoint(layer, preserve_rng_state=False)
        elif mode == "selective":
            checkpoint(layer, preserve_rng_state=False,
                       context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
