"""Apply a TorchLowering to this rank's model parts (the whole model, or its pipeline chunks).

The order is fixed, as in torchtitan, because each step must see what the previous made:

  1. tensor / sequence parallel: parameters become DTensors sharded over tp; expert
     parallel: MoE layers keep their local experts (plain tensors) and get their groups;
  2. materialize + init: after TP so a rank allocates only its TP shard, and before FSDP
     reshards the parameters; then context parallel, which takes this rank's rotary rows from
     the initialised tables and swaps the attention cores (no parameters of its own);
  3. activation checkpointing: hooks the TP-parallel layers, so recompute re-runs them;
  4. torch.compile per layer: after AC so the compiled region includes the recompute;
  5. data parallel / ZeRO (DDP, ZeroRedundancyOptimizer, FSDP2, or the shared engine):
     last, it replicates or shards the final parameters and hooks their gradients; then the
     engine joins the embedding group, whose copies (MTP under pp) it sums after reducing.
"""
from __future__ import annotations

import torch
from torch import nn

from ms_llm.strategy.plan import ModelPlan
from torch_backend.lower import TorchLowering
from torch_backend.mesh import Meshes
from torch_backend.parallelize.ac import apply_ac
from torch_backend.parallelize.cp import apply_cp
from torch_backend.parallelize.dp import DataParallel
from torch_backend.parallelize.ep import apply_ep
from torch_backend.weights import materialize


def apply_compile(part: nn.Module) -> None:
    """Compile each decoder layer in place (Module.compile keeps parameter names)."""
    for layer in part.model.layers.values():
        layer.compile()


def parallelize(parts: list[nn.Module], low: TorchLowering, plan: ModelPlan, meshes: Meshes, dp: DataParallel,
                device: torch.device, rank: int) -> list[nn.Module]:
    """`parts`: this rank's model chunks on the meta device. Returns them ready to train."""
    for part in parts:
        if low.tp:
            from torch_backend.parallelize.tp import apply_tp      # DTensor: loaded only under tp
            apply_tp(part, low, meshes["tp"])
        if plan.model.moe is not None:
            apply_ep(part, plan, meshes)
        materialize(part, plan, device, rank, plan.train.seed)
        if low.cp is not None:
            apply_cp(part, low.cp, meshes.group("cp"), plan.train.seq_len)
        apply_ac(part, low)
        if low.compile:
            apply_compile(part)
    parts = dp.wrap(parts)
    dp.tie_embedding(plan, parts)
    return parts
