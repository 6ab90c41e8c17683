"""Apply a Lowering to a MindSpore network: shard() every primitive, pipeline_stage and
recompute on cells, the auto-parallel context, and the AutoParallel wrapper (the newer API).

On a CPU machine all of this runs and is checked by MindSpore's own argument checks;
compiling the sharded graph needs Ascend (or GPU), where the same calls train."""
from __future__ import annotations

from pathlib import Path

import mindspore as ms
from mindspore import nn

from ms_llm.mindspore.lower import Lowering
from ms_llm.mindspore.lower_moe import token_groups
from ms_llm.mindspore.model import LossCell
from ms_llm.mindspore.moe import set_token_groups
from ms_llm.mindspore.op_strategy import LayoutStrategy


def _resolve(root: LossCell, path: str):
    """'model.layers.3.self_attn.softmax' -> the object; 'loss.*' lives on the LossCell, the rest on its net."""
    obj = root if path.split(".")[0] == "loss" else root.net
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, nn.CellList) else getattr(obj, part)
    return obj


def _build(strategies):
    return tuple(s.build() if isinstance(s, LayoutStrategy) else tuple(s) for s in strategies)


def apply_lowering(net: LossCell, low: Lowering) -> LossCell:
    """Set every op's shard strategy, every cell's pipeline stage, recompute and the MoE layers'
    token groups, in place."""
    if low.plan.model.moe is not None:
        set_token_groups(net, token_groups(low.plan))
    for op in low.ops:
        prim = _resolve(net, op.op)
        if op.output is None:
            prim.shard(in_strategy=_build(op.inputs))
        else:
            prim.shard(in_strategy=_build(op.inputs), out_strategy=_build(op.output))
        for name, value in op.attrs:
            prim.add_prim_attr(name, value)
    interleaved = low.plan.strategy.pipeline.virtual_stages > 1
    if low.plan.strategy.pp > 1:
        for path, (stage, segment) in low.cell_stages.items():
            cell = _resolve(net, path)
            cell.pipeline_stage = stage
            if interleaved:
                cell.pipeline_segment = segment
    for path in low.recompute_cells:
        _resolve(net, path).recompute()
    for path in low.recompute_ops:
        _resolve(net, path).recompute()
    return net


def set_context(low: Lowering) -> None:
    ms.set_auto_parallel_context(**low.context)


def auto_parallel(net: nn.Cell, low: Lowering, strategy_file: str | Path):
    """The same context through mindspore.parallel.auto_parallel.AutoParallel's methods."""
    from mindspore.parallel.auto_parallel import AutoParallel

    mode = "semi_auto" if low.context["parallel_mode"] == "semi_auto_parallel" else "sharding_propagation"
    wrapped = AutoParallel(net, parallel_mode=mode)
    wrapped.dataset_strategy(low.context["dataset_strategy"])
    if "pipeline_stages" in low.context:
        cfg = low.context["pipeline_config"]
        wrapped.pipeline(stages=low.context["pipeline_stages"], interleave=cfg["pipeline_interleave"],
                         scheduler=cfg["pipeline_scheduler"])
    if low.context["enable_parallel_optimizer"]:
        cfg = low.context["parallel_optimizer_config"]
        wrapped.hsdp(shard_size=cfg["optimizer_weight_shard_size"], threshold=cfg["parallel_optimizer_threshold"],
                     optimizer_level=cfg["optimizer_level"])
    wrapped.save_param_strategy_file(str(strategy_file))
    return wrapped
