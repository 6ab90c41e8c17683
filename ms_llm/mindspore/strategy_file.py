"""MindSpore strategy checkpoint files, written from our layouts (layouts in -> file out).

MindSpore writes these itself only when it compiles a sharded graph, which it refuses
to do on CPU; its checkpoint tools (build_searched_strategy, merge_sliced_parameter,
transform_checkpoints, load_distributed_checkpoint) read them to know how each rank's
slice of a parameter sits in the full tensor. The format is the protobuf
mindspore.train.node_strategy_pb2.ParallelStrategyMap; per parameter:

    dev_matrix      device matrix, outermost first; ranks are row-major over it
    tensor_map      per tensor dim, k = split along dev_matrix[len - 1 - k], -1 = not split
    opt_weight_shard_size / _step   the parallel optimizer's (ZeRO's) extra split of dim 0,
                    nested inside the tensor-parallel split: group size and rank stride
    param_split_shape, indices_offset   one empty entry each (MindSpore requires them)

Op strategies (parallel_strategy_item: node name, stage, split counts per input) ride
along; merge_pipeline_strategys reads each file's stage from them. Pipeline stages get one
file per stage (current_stage = stage) holding that stage's parameters.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ms_llm.errors import StrategyError
from ms_llm.strategy.layout import Shard, TensorLayout


OpStrategies = Mapping[str, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class ParamStrategy:
    """One parameter's entry: how its full tensor is cut over the ranks of one stage."""
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]
    opt_shard_size: int = 0
    opt_shard_step: int = 0
    field: int = 0


def param_strategy(layout: TensorLayout, optimizer_layout: Optional[TensorLayout] = None) -> ParamStrategy:
    """The entry for a parameter whose slices were cut by `optimizer_layout` (ZeRO's split
    added to the tensor-parallel `layout`; None or equal: no ZeRO split).

    A ZeRO split that is the only split of its dimension is an ordinary tensor map. One
    nested inside the tensor-parallel split of dim 0 is what opt_weight_shard_* describe;
    MindSpore gives that split to the innermost replicated device axes, so those must be
    exactly the ZeRO axes.
    """
    if optimizer_layout is None or optimizer_layout == layout:
        return _entry(layout)
    try:
        return _entry(optimizer_layout)
    except StrategyError:
        pass                                   # nested inside tp: needs the optimizer-shard fields
    mesh = layout.mesh
    zero_axes = [a for a, p, q in zip(mesh.names, layout.placements, optimizer_layout.placements)
                 if p != q and mesh.axis_size(a) > 1]
    if {optimizer_layout.placements[mesh.names.index(a)] for a in zero_axes} != {Shard(0)}:
        raise StrategyError(f"strategy file: ZeRO splits a {layout.shape} parameter inside its tensor-parallel "
                            "split of a dimension other than 0; MindSpore's parallel optimizer splits dim 0 only")
    replicated = [a for a, p in zip(mesh.names, layout.placements) if not isinstance(p, Shard) and mesh.axis_size(a) > 1]
    if replicated[len(replicated) - len(zero_axes):] != zero_axes:
        raise StrategyError(f"strategy file: ZeRO axes {zero_axes} are not the innermost replicated axes "
                            f"{replicated} of a {layout.shape} parameter; MindSpore cannot describe that split")
    size = math.prod(mesh.axis_size(a) for a in zero_axes)
    step = math.prod(mesh.shape[mesh.names.index(zero_axes[-1]) + 1:])
    base = _entry(layout)
    return ParamStrategy(base.dev_matrix, base.tensor_map, size, step)


def _entry(layout: TensorLayout) -> ParamStrategy:
    ms = layout.to_ms_merged()
    return ParamStrategy(tuple(ms.dev_matrix), tuple(int(k) for k in ms.tensor_map))


def strategy_map(params: Mapping[str, ParamStrategy], stage: int = 0, ops: Optional[OpStrategies] = None):
    """The ParallelStrategyMap protobuf message for these parameters (and op strategies)."""
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    msg = ParallelStrategyMap()
    msg.current_stage = stage
    for name in sorted(ops or {}):
        item = msg.parallel_strategy_item.add()
        item.node_name = name
        item.parallel_strategys.stage = stage
        for dims in ops[name]:
            item.parallel_strategys.parallel_strategy.add().dim.extend(dims)
    for name in sorted(params):
        entry = params[name]
        item = msg.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend(entry.dev_matrix)
        lay.tensor_map.add().dim.extend(entry.tensor_map)
        lay.param_split_shape.add()
        lay.indices_offset.add()
        lay.field = entry.field
        lay.opt_weight_shard_step = entry.opt_shard_step
        lay.opt_weight_shard_size = entry.opt_shard_size
    return msg


def write_strategy_file(path: str | Path, params: Mapping[str, ParamStrategy], stage: int = 0,
                        ops: Optional[OpStrategies] = None) -> Path:
    """Write atomically (temporary name, fsync, rename): a reader never sees half a file.
    `ops` (op name -> split counts per input) carries the stage that merge_pipeline_strategys
    reads; MindSpore's own files always have them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = strategy_map(params, stage, ops).SerializeToString()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_strategy_file(path: str | Path) -> tuple[int, dict[str, ParamStrategy]]:
    """(current_stage, {name: entry}) of a file written by us or by MindSpore."""
    from google.protobuf.message import DecodeError
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    msg = ParallelStrategyMap()
    try:
        msg.ParseFromString(Path(path).read_bytes())
    except (OSError, DecodeError) as exc:
        raise StrategyError(f"{path}: not a readable MindSpore strategy file ({exc})") from None
    out = {}
    for item in msg.parallel_layout_item:
        lay = item.parallel_layouts
        out[item.param_name] = ParamStrategy(tuple(lay.dev_matrix[0].dim), tuple(lay.tensor_map[0].dim),
                                             lay.opt_weight_shard_size, lay.opt_weight_shard_step, lay.field)
    return msg.current_stage, out
