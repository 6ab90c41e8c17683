"""Activation checkpointing per decoder layer, as the lowering's recompute says.

full:      keep only the layer's input; recompute the whole layer in backward.
selective: keep the outputs of the ops lowering.selective_saves names (matmuls, collectives);
           recompute the cheap rest.

The composable `checkpoint` works through module hooks, so parameter names stay the
canonical ones (engines and checkpoints address parameters by name).
"""
from __future__ import annotations

from functools import partial, reduce

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from torch_backend.lower import TorchLowering


def _op(name: str):
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    return reduce(getattr, name.split("."), torch.ops)


def apply_ac(part: nn.Module, low: TorchLowering) -> None:
    """Checkpoint each decoder layer of `part` whose recompute mode is not 'none'."""
    # A list of ops: torch saves their outputs and prefers to recompute every other op's.
    saves = [_op(name) for name in low.selective_saves]
    for key, layer in part.model.layers.items():
        mode = low.recompute[int(key)]
        if mode == "full":
            checkpoint(layer, preserve_rng_state=False)
        elif mode == "selective":
            checkpoint(layer, preserve_rng_state=False,
                       context_fn=partial(create_selective_checkpoint_contexts, saves))
