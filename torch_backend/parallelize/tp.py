"""Tensor and sequence parallelism: the lowering's TpStyle data as DTensor ParallelStyles.

Which module gets which style, with which placements, is decided in torch_backend.lower from
the plan's layouts; here each TpStyle becomes the ParallelStyle of its kind, for the modules a
part (the whole model or a pipeline stage) holds.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from ms_llm.strategy import layout as L
from torch_backend.lower import TorchLowering, TpStyle
from torch_backend.moe_dispatch import CopyToTp


class LatentParallel(ParallelStyle):
    """A replicated module (MLA's kv_a_proj_with_mqa) whose last `shared` output features (the
    rotary key) every rank's heads read directly: identity forward; in backward each rank holds
    its heads' share of their gradient, which is summed over tp (Megatron's copy to the tensor-
    parallel region). The other features' gradient comes whole out of the column-parallel
    up-projection they feed."""

    def __init__(self, *, shared: int):
        super().__init__()
        self.shared = shared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def sum_shared_grad(_module, _args, out: torch.Tensor) -> torch.Tensor:
            kept, shared = out.split([out.shape[-1] - self.shared, self.shared], dim=-1)
            return torch.cat([kept, CopyToTp.apply(shared, group)], dim=-1)

        module.register_forward_hook(sum_shared_grad)
        return module


def torch_placement(p: L.Placement) -> Placement:
    if isinstance(p, L.Shard):
        return Shard(p.dim)
    if isinstance(p, L.Partial):
        return Partial(p.reduce_op)
    return Replicate()


def parallel_style(style: TpStyle, module: nn.Module) -> ParallelStyle:
    """`module`: the one the style applies to (prepare_input pads its other forward arguments)."""
    given, out = torch_placement(style.input), torch_placement(style.output)
    if style.kind == "colwise":
        return ColwiseParallel(input_layouts=given, output_layouts=out, use_local_output=style.use_local_output)
    if style.kind == "rowwise":
        return RowwiseParallel(input_layouts=given, output_layouts=out, use_local_output=style.use_local_output)
    if style.kind == "sequence":
        return SequenceParallel(sequence_dim=style.input.dim, use_local_output=style.use_local_output)
    if style.kind == "latent":
        return LatentParallel(shared=style.shared)
    rest = (None,) * (len(inspect.signature(module.forward).parameters) - 1)   # rotary tables stay local
    return PrepareModuleInput(input_layouts=(given, *rest), desired_input_layouts=(out, *rest),
                              use_local_output=style.use_local_output)


def tp_styles(low: TorchLowering, part: nn.Module) -> dict[str, ParallelStyle]:
    """FQN -> ParallelStyle for the modules `part` holds."""
    present = dict(part.named_modules())
    return {s.module: parallel_style(s, present[s.module]) for s in low.tp if s.module in present}


def apply_tp(part: nn.Module, low: TorchLowering, tp_mesh: DeviceMesh) -> None:
    parallelize_module(part, tp_mesh, tp_styles(low, part))
