"""MindSpore strategy checkpoint files from ms_llm TensorLayouts, and back.

A strategy file (protobuf `mindspore.train.node_strategy_pb2.ParallelStrategyMap`, or its
JSON form) gives each parameter a device matrix, a tensor map (value k = split along
dev_matrix[len - 1 - k], -1 = not split) and the parallel optimizer's opt_weight_shard_size
/ opt_weight_shard_step (a further split of dim 0 inside its model-parallel slice over the
innermost repeated device axes). MindSpore's transform_checkpoints, merge_sliced_parameter
and load_distributed_checkpoint read these files; the MindSpore lowering writes the same
files for its parameters by calling `write_strategy_file`.

A ZeRO layout is written as an optimizer shard only when MindSpore's rule reproduces it:
ZeRO splits dim 0 and no replicated device axis lies inside the ZeRO axes. Otherwise the
tensor-parallel layout is written and the per-rank files hold tensor-parallel slices.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mindspore.train import node_strategy_pb2 as pb

from ms_llm.errors import CheckpointError
from ms_llm.mindspore.layout import MsLayout, TensorMap, from_ms, to_ms_merged
from ms_llm.strategy.layout import Replicate, Shard, TensorLayout
from ms_llm.strategy.mesh import MeshSpec


@dataclass(frozen=True)
class MsParamLayout:
    dev_matrix: tuple[int, ...]
    tensor_map: TensorMap
    opt_shard_size: int = 0          # 0 = no optimizer shard; -1 = all repeated devices
    opt_shard_step: int = 0


def ms_param_layout(layout: TensorLayout, zero_layout: Optional[TensorLayout] = None
                    ) -> tuple[MsParamLayout, TensorLayout]:
    """The strategy-file entry for a parameter, and the TensorLayout whose slices the per-rank
    checkpoint files must hold under it (`zero_layout` when expressible, else `layout`)."""
    ms = to_ms_merged(layout)
    base = MsParamLayout(ms.dev_matrix, ms.tensor_map)
    if zero_layout is None or zero_layout == layout:
        return base, layout
    names = layout.mesh.names
    added = [a for a, p, q in zip(names, layout.placements, zero_layout.placements) if p != q]
    if any(q != Shard(0) for a, q in zip(names, zero_layout.placements) if a in added):
        return base, layout
    if list(zero_layout.axes_of(0))[-len(added):] != added:
        return base, layout
    inner = names[names.index(added[-1]) + 1:]
    if any(layout.mesh.axis_size(a) > 1 and isinstance(p, Replicate)
           for a, p in zip(names, layout.placements) if a in inner):
        return base, layout
    size = math.prod(layout.mesh.axis_size(a) for a in added)
    step = math.prod(layout.mesh.axis_size(a) for a in inner)
    return MsParamLayout(ms.dev_matrix, ms.tensor_map, size, step), zero_layout


def to_layout(shape: tuple[int, ...], entry: MsParamLayout) -> TensorLayout:
    """The TensorLayout of an entry, optimizer shard included (MindSpore's rule: take repeated
    device axes innermost first, splitting the last one taken if it is larger than needed).
    Device axis i is named d<i>; a split axis becomes d<i>r (outer) and d<i>o."""
    dev, tmap = entry.dev_matrix, entry.tensor_map
    names = tuple(f"d{i}" for i in range(len(dev)))
    base = from_ms(tuple(shape), MsLayout(tuple(dev), tuple(tmap)), names)
    if entry.opt_shard_size == 0:
        return base
    used = {n for d in range(len(shape)) for n in base.axes_of(d)}
    repeated = [i for i, n in enumerate(dev) if n > 1 and names[i] not in used]
    remaining = entry.opt_shard_size if entry.opt_shard_size > 0 else math.prod(dev[i] for i in repeated)
    take: dict[int, int] = {}
    for i in reversed(repeated):
        if remaining == 1:
            break
        part = min(dev[i], remaining)
        if dev[i] % part or remaining % part:
            raise CheckpointError(f"strategy file: optimizer shard size {entry.opt_shard_size} does not divide the "
                                  f"repeated device axes of dev_matrix {dev}")
        take[i] = part
        remaining //= part
    if remaining != 1:
        raise CheckpointError(f"strategy file: optimizer shard size {entry.opt_shard_size} exceeds the repeated "
                              f"devices of dev_matrix {dev}")
    mesh_names, sizes, placements, opt_axes = [], [], [], []
    for i, n in enumerate(dev):
        if i in take and take[i] < n:
            mesh_names += [f"d{i}r", f"d{i}o"]
            sizes += [n // take[i], take[i]]
            placements += [Replicate(), Shard(0)]
            opt_axes.append(f"d{i}o")
        else:
            mesh_names.append(names[i])
            sizes.append(n)
            placements.append(Shard(0) if i in take else base.placements[i])
            if i in take:
                opt_axes.append(names[i])
    order = tuple(base.axes_of(0)) + tuple(opt_axes)
    order += tuple(a for a in mesh_names if a not in order)
    return TensorLayout(tuple(shape), MeshSpec(tuple(mesh_names), tuple(sizes)), tuple(placements), order)


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
