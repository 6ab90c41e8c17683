"""Placements per mesh axis and the tensor layouts built from them.

A TensorLayout says, for each axis of a named mesh, whether a tensor is split along one
of its dimensions (Shard(dim)), copied (Replicate) or holds a partial sum (Partial). This
is torch DTensor's vocabulary one to one; a MindSpore device matrix + tensor map is derived
from it in ms_llm.mindspore.layout. When several mesh axes split the same
dimension, the outer axis is the major split (DTensor's and MindSpore's convention)
unless `order` says otherwise: ZeRO splits the tensor-parallel shard further, so its
layouts nest the data-parallel axes inside tp (what DTensor calls a strided shard and
MindSpore's parallel optimizer does to the tp slice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from ms_llm.errors import StrategyError
from ms_llm.strategy.mesh import MeshSpec, rank_to_coords


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


Placement = Union[Shard, Replicate, Partial]


def parse_placement(text: str) -> Placement:
    """Inverse of str(placement): 'S(0)', 'R', 'P(sum)'."""
    if text == "R":
        return Replicate()
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    raise StrategyError(f"placement: cannot parse {text!r}; expected 'S(dim)', 'R' or 'P(sum)'")


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    mesh: MeshSpec
    placements: tuple[Placement, ...]
    order: tuple[str, ...] = ()    # split nesting, major first; () = mesh order

    def __post_init__(self) -> None:
        if self.order and sorted(self.order) != sorted(self.mesh.names):
            raise StrategyError(f"layout: order {self.order} must list each mesh axis {self.mesh.names} once")
        if len(self.placements) != len(self.mesh.names):
            raise StrategyError(f"layout: {len(self.placements)} placements for mesh {self.mesh.describe()}")
        for axis, p in zip(self.mesh.names, self.placements):
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise StrategyError(f"layout: axis {axis} shards dim {p.dim} of a {len(self.shape)}-d tensor")
        object.__setattr__(self, "order", self._canonical_order())
        for d, size in enumerate(self.shape):
            parts = self.split_count(d)
            if size % parts:
                axes = "*".join(self.axes_of(d))
                raise StrategyError(f"layout: dim {d} of shape {self.shape} ({size}) is not divisible by "
                                    f"{axes} = {parts}")

    def _canonical_order(self) -> tuple[str, ...]:
        """Only the nesting of axes that split the same dim matters: () when it is mesh order,
        else each dim's axes (major first) followed by the rest, so equal layouts compare equal."""
        if not self.order:
            return ()
        per_dim = [self.axes_of(d) for d in range(len(self.shape))]
        if all(list(a) == sorted(a, key=self.mesh.names.index) for a in per_dim):
            return ()
        used = [a for axes in per_dim for a in axes]
        return tuple(used) + tuple(a for a in self.mesh.names if a not in used)

    @classmethod
    def replicated(cls, shape: tuple[int, ...], mesh: MeshSpec) -> "TensorLayout":
        return cls(tuple(shape), mesh, tuple(Replicate() for _ in mesh.names))

    @classmethod
    def build(cls, shape: tuple[int, ...], mesh: MeshSpec, **shards: int) -> "TensorLayout":
        """Layout with Shard(dim) on each named axis (`tp=0`), Replicate elsewhere."""
        unknown = [a for a in shards if a not in mesh.names]
        if unknown:
            raise StrategyError(f"layout: mesh {mesh.describe()} has no axis {unknown[0]!r}")
        return cls(tuple(shape), mesh, tuple(Shard(shards[n]) if n in shards else Replicate()
                                             for n in mesh.names))

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """Mesh axes that split tensor dimension `dim`, outermost (major) first."""
        axes = [n for n, p in zip(self.mesh.names, self.placements) if p == Shard(dim)]
        if self.order:
            axes.sort(key=self.order.index)
        return tuple(axes)

    def split_count(self, dim: int) -> int:
        return math.prod(self.mesh.axis_size(a) for a in self.axes_of(dim))

    @property
    def partial_axes(self) -> tuple[str, ...]:
        return tuple(n for n, p in zip(self.mesh.names, self.placements) if isinstance(p, Partial))

    def local_shape(self) -> tuple[int, ...]:
        return tuple(size // self.split_count(d) for d, size in enumerate(self.shape))

    def shard_box(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the global tensor of the piece mesh-rank `rank` holds."""
        coords = dict(zip(self.mesh.names, rank_to_coords(rank, self.mesh.shape)))
        local = self.local_shape()
        offsets = []
        for d in range(len(self.shape)):
            index = 0
            for axis in self.axes_of(d):
                index = index * self.mesh.axis_size(axis) + coords[axis]
            offsets.append(index * local[d])
        return tuple(offsets), local

    def ms_strategy(self) -> tuple[int, ...]:
        """The per-dimension split counts MindSpore's Primitive.shard takes for this input."""
        return tuple(self.split_count(d) for d in range(len(self.shape)))

    def to_dtensor(self) -> tuple[str, ...]:
        """DTensor placements per mesh axis, as DTensor prints them ('S(0)', 'R', 'P(sum)')."""
        for d in range(len(self.shape)):
            axes = self.axes_of(d)
            if list(axes) != sorted(axes, key=self.mesh.names.index):
                raise StrategyError(f"layout: dim {d} is split {'/'.join(axes)} inner-to-outer; plain DTensor "
                                    "placements cannot say that (FSDP2 builds its strided shard itself)")
        return tuple(str(p) for p in self.placements)

    @classmethod
    def from_dtensor(cls, shape: tuple[int, ...], mesh: MeshSpec, placements) -> "TensorLayout":
        return cls(tuple(shape), mesh, tuple(parse_placement(str(p)) for p in placements))

    def with_order(self, major_first: tuple[str, ...]) -> "TensorLayout":
        return TensorLayout(self.shape, self.mesh, self.placements, tuple(major_first))

    def permute(self, perm: tuple[int, ...]) -> "TensorLayout":
        """The layout of the transposed tensor: new dim i is old dim perm[i]."""
        if sorted(perm) != list(range(len(self.shape))):
            raise StrategyError(f"layout: {perm} is not a permutation of the {len(self.shape)} dims of {self.shape}")
        placements = tuple(Shard(perm.index(p.dim)) if isinstance(p, Shard) else p for p in self.placements)
        return TensorLayout(tuple(self.shape[d] for d in perm), self.mesh, placements, self.order)

    def group_dims(self, groups: tuple[tuple[int, ...], ...]) -> "TensorLayout":
        """The layout after a reshape that merges runs of adjacent dims (each group, in order;
        an empty group is a new size-1 dim), as MindSpore's Reshape infers it: a merged dim is
        split by the axes of its parts, major-first in dim order. A rank's piece is then the
        reshape of its old piece when, in each group, every dim after the first split one is
        whole and every dim before it has local size 1; otherwise the backend redistributes."""
        if [d for g in groups for d in g] != list(range(len(self.shape))):
            raise StrategyError(f"layout: groups {groups} must cover dims 0..{len(self.shape) - 1} in order")
        new_dim = {d: i for i, g in enumerate(groups) for d in g}
        placements = tuple(Shard(new_dim[p.dim]) if isinstance(p, Shard) else p for p in self.placements)
        shape = tuple(math.prod(self.shape[d] for d in g) for g in groups)
        nesting = [a for d in range(len(self.shape)) for a in self.axes_of(d)]
        order = tuple(nesting) + tuple(a for a in self.mesh.names if a not in nesting)
        layout = TensorLayout(shape, self.mesh, placements)
        if any(layout.axes_of(i) != tuple(a for a in order if a in layout.axes_of(i)) for i in range(len(shape))):
            layout = layout.with_order(order)
        return layout

    def replicate_dim(self, dim: int) -> "TensorLayout":
        """The same layout with dimension `dim` whole on every rank (e.g. keys gathered over cp)."""
        placements = tuple(Replicate() if p == Shard(dim) else p for p in self.placements)
        return TensorLayout(self.shape, self.mesh, placements, self.order)

    def describe(self) -> str:
        parts = [f"{n}:{p}" for n, p in zip(self.mesh.names, self.placements) if not isinstance(p, Replicate)]
        return ", ".join(parts) or "replicated"
