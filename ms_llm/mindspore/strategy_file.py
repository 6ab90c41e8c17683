"""MindSpore strategy checkpoint files from ms_llm TensorLayouts, and back.

A strategy file (protobuf `mindspore.train.node_strategy_pb2.ParallelStrategyMap`, or its
JSON form) gives each parameter a device matrix, a tensor map (value k = split along
dev_matrix[len - 1 - k], -1 = not split) and the parallel optimizer's opt_weight_shard_size
/ opt_weight_shard_step (a further split of dim 0 inside its model-parallel slice over the
innermost repeated device axes). MindSpore's transform_checkpoints, merge_sliced_parameter
and load_distributed_checkpoint read these files; the MindSpore lowering writes the same
files for its parameters by calling `write_strategy_file`.

A ZeRO layout is written as an optimizer shard only when it is MindSpore's own split
(layout.parallel_optimizer_layout: dim 0 over consecutive ranks holding the same slice);
otherwise the tensor-parallel layout is written and the per-rank files hold tensor-parallel slices.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mindspore.train import node_strategy_pb2 as pb

from ms_llm.errors import CheckpointError, StrategyError
from ms_llm.mindspore.layout import MsLayout, TensorMap, from_ms, optimizer_split, parallel_optimizer_layout, \
    to_ms_merged
from ms_llm.strategy.layout import Replicate, TensorLayout


@dataclass(frozen=True)
class MsParamLayout:
    dev_matrix: tuple[int, ...]
    tensor_map: TensorMap
    opt_shard_size: int = 0          # 0 = no optimizer shard; -1 = all repeated devices
    opt_shard_step: int = 0


def ms_param_layout(layout: TensorLayout, zero_layout: Optional[TensorLayout] = None
                    ) -> tuple[MsParamLayout, TensorLayout]:
    """The strategy-file entry for a parameter, and the TensorLayout whose slices the per-rank
    checkpoint files must hold under it: `zero_layout` where it is MindSpore's parallel-optimizer
    split of `layout` (layout.parallel_optimizer_layout, what lower.parallel_optimizer_plan gives),
    else `layout`."""
    ms = to_ms_merged(layout)
    base = MsParamLayout(ms.dev_matrix, ms.tensor_map)
    if zero_layout is None or zero_layout == layout:
        return base, layout
    size = zero_layout.split_count(0) // layout.split_count(0)
    if size < 2 or parallel_optimizer_layout(layout, size) != zero_layout:
        return base, layout
    return MsParamLayout(ms.dev_matrix, ms.tensor_map, size, opt_shard_step(layout)), zero_layout


def opt_shard_step(layout: TensorLayout) -> int:
    """opt_weight_shard_step as MindSpore saves it: over the ranks holding rank 0's slice, in rank
    order, (last - first) / (count - 1)."""
    mesh, stride, last, count = layout.mesh, 1, 0, 1
    for n, p in reversed(list(zip(mesh.shape, layout.placements))):
        if isinstance(p, Replicate):
            last += (n - 1) * stride
            count *= n
        stride *= n
    return last // (count - 1)


def to_layout(shape: tuple[int, ...], entry: MsParamLayout) -> TensorLayout:
    """The TensorLayout of an entry, optimizer shard included (MindSpore's rule: take repeated
    device axes innermost first, splitting the last one taken if it is larger than needed).
    Device axis i is named d<i>; a split axis becomes d<i>_outer and d<i>_inner."""
    dev, tmap = entry.dev_matrix, entry.tensor_map
    names = tuple(f"d{i}" for i in range(len(dev)))
    base = from_ms(tuple(shape), MsLayout(tuple(dev), tuple(tmap)), names)
    if entry.opt_shard_size == 0:
        return base
    used = {n for d in range(len(shape)) for n in base.axes_of(d)}
    repeated = math.prod(n for i, n in enumerate(dev) if names[i] not in used)
    size = repeated if entry.opt_shard_size == -1 else entry.opt_shard_size
    if repeated % size:
        raise CheckpointError(f"strategy file: optimizer shard size {entry.opt_shard_size} does not divide the "
                              f"{repeated} repeated devices of dev_matrix {dev}")
    try:
        return optimizer_split(base, size)
    except StrategyError as exc:
        raise CheckpointError(f"strategy file: optimizer shard size {entry.opt_shard_size} over dev_matrix {dev}: "
                              f"{exc}") from None


def write_strategy_file(path: str | Path, entries: dict[str, MsParamLayout], stage: int = 0,
                        strategies: Optional[dict[str, tuple[int, ...]]] = None) -> None:
    """Write a protobuf ParallelStrategyMap for one pipeline stage. `strategies` optionally
    gives the per-dim split counts recorded as each parameter's operator strategy."""
    smap = pb.ParallelStrategyMap()
    smap.current_stage = stage
    for name, e in entries.items():
        item = smap.parallel_strategy_item.add()
        item.node_name = name
        item.parallel_strategys.stage = stage
        ps = item.parallel_strategys.parallel_strategy.add()
        ps.dim.extend((strategies or {}).get(name, ()))
        lay = smap.parallel_layout_item.add()
        lay.param_name = name
        layouts = lay.parallel_layouts
        layouts.dev_matrix.add().dim.extend(e.dev_matrix)
        if any(isinstance(k, tuple) for k in e.tensor_map):
            for k in e.tensor_map:
                layouts.tensor_map.add().dim.extend(k if isinstance(k, tuple) else (k,))
        else:
            layouts.tensor_map.add().dim.extend(e.tensor_map)
        layouts.param_split_shape.add()      # one empty entry each: MindSpore's readers index [0]
        layouts.indices_offset.add()
        layouts.field = 0
        layouts.opt_weight_shard_size = e.opt_shard_size
        layouts.opt_weight_shard_step = e.opt_shard_step
    Path(path).write_bytes(smap.SerializeToString())


def read_strategy_file(path: str | Path) -> tuple[dict[str, MsParamLayout], Optional[int]]:
    """Entries of a protobuf or JSON strategy file and its pipeline stage (None if unrecorded).
    Names keep MindSpore's '<stage>-' prefix in files merged by merge_pipeline_strategys."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: strategy file is missing") from None
    if path.suffix == ".json":
        data = json.loads(raw)
        items = data.get("parallel_strategy_item") or {}
        stage = next(iter(items.values())).get("stage") if items else None
        return {n: _entry(v["dev_matrix"], v["tensor_map"], v.get("opt_weight_shard_size", 0),
                          v.get("opt_weight_shard_step", 0))
                for n, v in data.get("parallel_layout_item", {}).items()}, stage
    smap = pb.ParallelStrategyMap()
    try:
        smap.ParseFromString(raw)
    except Exception as exc:                  # protobuf's DecodeError has no stable import path
        raise CheckpointError(f"{path}: not a MindSpore strategy file ({exc})") from None
    stage = smap.parallel_strategy_item[0].parallel_strategys.stage if smap.parallel_strategy_item else None
    out = {}
    for item in smap.parallel_layout_item:
        lay = item.parallel_layouts
        maps = [list(t.dim) for t in lay.tensor_map]
        tmap = maps[0] if len(maps) == 1 else [m[0] if len(m) == 1 else m for m in maps if m]
        out[item.param_name] = _entry(list(lay.dev_matrix[0].dim), tmap, lay.opt_weight_shard_size,
                                      lay.opt_weight_shard_step)
    return out, stage


def _entry(dev, tmap, size, step) -> MsParamLayout:
    return MsParamLayout(tuple(int(d) for d in dev),
                         tuple(tuple(int(x) for x in k) if isinstance(k, list) else int(k) for k in tmap),
                         int(size or 0), int(step or 0))
