"""Tensor and sequence parallelism: DTensor ParallelStyles derived from the plan's layouts.

Nothing here names a LLaMA layer. Each weight's placement on the tp axis, and the tp
placement of the activations around it, pick the style:

    weight Shard(0), kind embedding   -> RowwiseParallel   (vocab-parallel embedding)
    weight Shard(0), kind head        -> ColwiseParallel   (vocab-parallel logits for loss_parallel)
    weight Shard(0), kind column      -> ColwiseParallel
    weight Shard(1), kind row         -> RowwiseParallel   (output in the residual-stream layout)
    replicated norm, residual stream sharded on the sequence -> SequenceParallel

and where a block's input layout ("attn_input", "mlp_input") differs from the residual
stream ("hidden"), a PrepareModuleInput on the block redistributes it (the all-gather of
sequence parallelism; its reduce-scatter is the row-parallel output layout).
"""
from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from ms_llm.errors import StrategyError
from ms_llm.strategy import layout as L
from ms_llm.strategy.layout import TensorLayout
from ms_llm.strategy.plan import ModelPlan

# Which activation of the plan a block (by its attribute name) takes as input.
BLOCK_INPUT = {"self_attn": "attn_input", "mlp": "mlp_input"}


def torch_placement(p: L.Placement) -> Placement:
    if isinstance(p, L.Shard):
        return Shard(p.dim)
    if isinstance(p, L.Partial):
        return Partial(p.reduce_op)
    return Replicate()


def tp_placement(layout: TensorLayout) -> Placement:
    """The layout's placement on the tp axis, as a torch Placement."""
    return torch_placement(layout.placements[layout.mesh.names.index("tp")])


def tp_styles(plan: ModelPlan, module: nn.Module) -> dict[str, ParallelStyle]:
    """FQN -> ParallelStyle for the parameters `module` (a whole model or a pipeline stage) holds."""
    acts = plan.activations
    hidden = tp_placement(acts["hidden"])
    present = dict(module.named_parameters())
    styles: dict[str, ParallelStyle] = {}
    for p in plan.params.values():
        if p.name not in present:
            continue
        fqn, weight = p.name.removesuffix(".weight"), tp_placement(p.layout)
        if p.kind == "embedding" and weight == Shard(0):
            styles[fqn] = RowwiseParallel(input_layouts=tp_placement(acts["tokens"]), output_layouts=hidden)
        elif p.kind == "head" and weight == Shard(0):
            logits = tp_placement(acts["logits"])
            # Keep the vocab-sharded DTensor: loss_parallel computes the loss without gathering it.
            styles[fqn] = ColwiseParallel(input_layouts=hidden, output_layouts=logits,
                                          use_local_output=logits == Replicate())
        elif p.kind == "column" and weight == Shard(0):
            styles[fqn] = ColwiseParallel()
            block_fqn = fqn.rsplit(".", 1)[0]                      # model.layers.3.self_attn
            want = tp_placement(acts[BLOCK_INPUT[block_fqn.rsplit(".", 1)[-1]]])
            if want != hidden:
                n_args = len(inspect.signature(module.get_submodule(block_fqn).forward).parameters)
                rest = (None,) * (n_args - 1)
                styles[block_fqn] = PrepareModuleInput(input_layouts=(hidden, *rest),
                                                       desired_input_layouts=(want, *rest))
        elif p.kind == "row" and weight == Shard(1):
            styles[fqn] = RowwiseParallel(output_layouts=hidden)
        elif p.kind == "norm" and weight == Replicate():
            if hidden != Replicate():
                styles[fqn] = SequenceParallel(sequence_dim=hidden.dim)
        elif weight != Replicate():
            raise StrategyError(f"{p.name}: no tensor-parallel style for a {p.kind} weight placed "
                                f"{weight} on tp; the torch backend lowers column / row / embedding / head")
    return styles


def apply_tp(module: nn.Module, plan: ModelPlan, tp_mesh: DeviceMesh) -> None:
    parallelize_module(module, tp_mesh, tp_styles(plan, module))
