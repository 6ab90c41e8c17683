"""TensorLayout <-> MindSpore's encodings of a layout: device matrix + tensor map, and Layout aliases.

Framework-free: the lowering, the dry run and the strategy files compute these without
importing MindSpore. MindSpore numbers device axes from the innermost: tensor_map[d] = k
means dim d is split along dev_matrix[len(dev_matrix) - 1 - k]; -1 means not split; a tuple
means split along several device axes (major first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from ms_llm.errors import StrategyError
from ms_llm.strategy.layout import Placement, Replicate, Shard, TensorLayout
from ms_llm.strategy.mesh import MeshSpec

TensorMap = tuple[Union[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class MsLayout:
    """MindSpore's view: device matrix (outermost first) and a tensor map per tensor dim."""
    dev_matrix: tuple[int, ...]
    tensor_map: TensorMap


def to_ms(layout: TensorLayout) -> MsLayout:
    """Device matrix = mesh shape; each dim maps to the device axes that split it."""
    if layout.partial_axes:
        raise StrategyError(f"layout: a partial sum over {layout.partial_axes} has no MindSpore tensor map; "
                            "reduce it first")
    n = len(layout.mesh.names)
    tmap = []
    for d in range(len(layout.shape)):
        ks = tuple(n - 1 - layout.mesh.names.index(a) for a in layout.axes_of(d))
        tmap.append(-1 if not ks else ks[0] if len(ks) == 1 else ks)
    return MsLayout(tuple(layout.mesh.shape), tuple(tmap))


def to_ms_aliases(layout: TensorLayout) -> tuple[Union[str, tuple[str, ...]], ...]:
    """Per dim, the argument MindSpore's Layout(dev_matrix, mesh names)(...) takes:
    an axis name, a tuple of names (major first), or "None"."""
    out = []
    for d in range(len(layout.shape)):
        axes = layout.axes_of(d)
        out.append("None" if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def from_ms(shape: tuple[int, ...], ms: MsLayout, names: tuple[str, ...]) -> TensorLayout:
    """The TensorLayout a device matrix + tensor map describes, mesh axes named `names`."""
    if len(names) != len(ms.dev_matrix):
        raise StrategyError(f"layout: {len(names)} axis names for device matrix {ms.dev_matrix}")
    n = len(names)
    placements: list[Placement] = [Replicate() for _ in names]
    nesting: list[str] = []
    for d, k in enumerate(ms.tensor_map):
        for kk in (k if isinstance(k, tuple) else (k,)):
            if kk == -1:
                continue
            if not 0 <= kk < n:
                raise StrategyError(f"layout: tensor map value {kk} outside device matrix {ms.dev_matrix}")
            placements[n - 1 - kk] = Shard(d)
            nesting.append(names[n - 1 - kk])
    mesh = MeshSpec(tuple(names), tuple(ms.dev_matrix))
    layout = TensorLayout(tuple(shape), mesh, tuple(placements))
    order = tuple(nesting) + tuple(a for a in names if a not in nesting)
    if any(list(layout.axes_of(d)) != [a for a in order if a in layout.axes_of(d)] for d in range(len(shape))):
        layout = layout.with_order(order)
    return layout


def to_ms_merged(layout: TensorLayout) -> MsLayout:
    """The same layout with adjacent device axes that split one dim merged into one axis and
    size-1 axes dropped: the single-int-per-dim form strategy checkpoint files hold."""
    for d in range(len(layout.shape)):
        axes = layout.axes_of(d)
        if list(axes) != sorted(axes, key=layout.mesh.names.index):
            raise StrategyError(f"layout: dim {d} is split inner-to-outer ({'/'.join(axes)}); a strategy file "
                                "says that with opt_weight_shard_size/step, not the tensor map")
    groups: list[list[int]] = []   # runs of mesh axes that become one device axis
    owner: list[object] = []
    for i, (size, p) in enumerate(zip(layout.mesh.shape, layout.placements)):
        if size == 1:
            continue
        key = p.dim if isinstance(p, Shard) else None
        if groups and key is not None and owner[-1] == key and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
            owner.append(key)
    for key in set(k for k in owner if k is not None):
        if owner.count(key) > 1:
            raise StrategyError(f"layout: dim {key} is split by non-adjacent mesh axes {layout.axes_of(key)}; "
                                "MindSpore needs them adjacent in the device matrix")
    if layout.partial_axes:
        raise StrategyError(f"layout: a partial sum over {layout.partial_axes} has no MindSpore tensor map")
    dev = tuple(math.prod(layout.mesh.shape[i] for i in g) for g in groups) or (1,)
    n = len(dev)
    tmap = tuple(n - 1 - owner.index(d) if d in owner else -1 for d in range(len(layout.shape)))
    return MsLayout(dev, tmap)


def optimizer_split(layout: TensorLayout, size: int) -> TensorLayout:
    """`layout` with dimension 0 split further over `size` of the ranks holding each slice of it,
    consecutive in rank order: the innermost replicated mesh axes, the last one taken only in its
    inner factor where `size` ends inside it (that axis becomes <axis>_outer x <axis>_inner). A
    rank's place in its group is row-major over the axes taken, so they nest inside dim 0's own."""
    mesh = layout.mesh
    repeated = [a for a, n, p in zip(mesh.names, mesh.shape, layout.placements) if n > 1 and isinstance(p, Replicate)]
    taken: dict[str, int] = {}
    remaining = size
    for a in reversed(repeated):
        if remaining == 1:
            break
        n = mesh.axis_size(a)
        part = math.gcd(n, remaining)
        if part != min(n, remaining):
            raise StrategyError(f"layout: {size} consecutive ranks of the {'x'.join(repeated)} ranks holding each "
                                f"slice of {layout.shape} are no product of mesh axes; MindSpore's parallel "
                                "optimizer groups would cut across them")
        taken[a] = part
        remaining //= part
    if remaining != 1:
        raise StrategyError(f"layout: {size} ranks to split {layout.shape} over, but only "
                            f"{math.prod(mesh.axis_size(a) for a in repeated)} hold each slice of it")
    names, sizes, placements, opt_axes = [], [], [], []
    for a, n, p in zip(mesh.names, mesh.shape, layout.placements):
        if a in taken and taken[a] < n:
            names += [f"{a}_outer", f"{a}_inner"]
            sizes += [n // taken[a], taken[a]]
            placements += [Replicate(), Shard(0)]
            opt_axes.append(f"{a}_inner")
        else:
            names.append(a)
            sizes.append(n)
            placements.append(Shard(0) if a in taken else p)
            if a in taken:
                opt_axes.append(a)
    order = layout.axes_of(0) + tuple(opt_axes)
    order += tuple(a for a in names if a not in order)
    return TensorLayout(layout.shape, MeshSpec(tuple(names), tuple(sizes)), tuple(placements), order)


def parallel_optimizer_layout(layout: TensorLayout, shard_size: int) -> TensorLayout:
    """Where MindSpore's parallel optimizer (semi_auto_parallel, optimizer_weight_shard_size
    `shard_size`, threshold 0) puts a weight's optimizer state, and at level 3 the weight. As
    OperatorInfo::CreateGroupForOptShard: the ranks holding the same slice, in rank order, are cut
    into consecutive groups of `shard_size` (-1: one group of all), and each splits dimension 0 of
    its slice; the weight stays as it is where no rank repeats its slice, `shard_size` does not
    divide the repeating ranks, or dimension 0 of the slice does not divide (OptParamMgr). For a
    weight every tp rank holds whole this is tp first, not the data-parallel ranks."""
    mesh = layout.mesh
    repeated = math.prod(n for n, p in zip(mesh.shape, layout.placements) if isinstance(p, Replicate))
    size = repeated if shard_size == -1 else shard_size
    if size == 1 or repeated % size or layout.local_shape()[0] % size:
        return layout
    return optimizer_split(layout, size)
