"""Pieces of a global tensor and the arithmetic to move data between them.

A Region is what one rank holds of a global tensor: a box (offsets, sizes) and, for ZeRO
flat-buffer slices, the run [start, stop) of that box's row-major order it owns (the
whole box when `flat` is None). Any region splits into at most 2*ndim - 1 sub-boxes, each
contiguous in the region's flat data, so copying between any saved region and any wanted
region is a handful of box intersections: one byte range when the overlap is contiguous on
both sides (`byte_run`), numpy slicing otherwise.

    >>> [(b.offsets, b.sizes, b.start) for b in Region((0, 0), (4, 4), (2, 13)).pieces()]
    [((0, 2), (1, 2), 0), ((1, 0), (2, 4), 2), ((3, 0), (1, 1), 10)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional


Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class SubBox:
    """A box contiguous in a region's flat data, starting at element `start` of it."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Region:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: Optional[tuple[int, int]] = None   # [start, stop) of the box's row-major order

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(map(int, self.offsets)))
        object.__setattr__(self, "sizes", tuple(map(int, self.sizes)))
        if self.flat is not None:
            a, b = int(self.flat[0]), int(self.flat[1])
            if not 0 <= a <= b <= math.prod(self.sizes):
                raise ValueError(f"flat range {self.flat} outside a box of {math.prod(self.sizes)} elements")
            object.__setattr__(self, "flat", None if (a, b) == (0, math.prod(self.sizes)) else (a, b))

    @classmethod
    def of_ints(cls, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> "Region":
        """A whole box from tuples already known to hold ints (a parsed index holds thousands:
        this skips the conversions of __post_init__)."""
        region = object.__new__(cls)
        object.__setattr__(region, "offsets", offsets)
        object.__setattr__(region, "sizes", sizes)
        object.__setattr__(region, "flat", None)
        return region

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat else math.prod(self.sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the data array this region holds: the box, or 1-d for a flat slice."""
        return (self.numel,) if self.flat else self.sizes

    def pieces(self) -> list[SubBox]:
        """Sub-boxes covering the region, each contiguous in its flat data (start is relative
        to the region's first element)."""
        return self._pieces

    @cached_property
    def _pieces(self) -> list[SubBox]:          # every read intersects them: computed once
        if self.flat is None:
            return [SubBox(self.offsets, self.sizes, 0)]
        a, b = self.flat
        return [SubBox(tuple(o + off for o, off in zip(p.offsets, self.offsets)), p.sizes, p.start - a)
                for p in _flat_to_boxes(self.sizes, a, b)]

    def cuts(self, shape: tuple[int, ...]) -> Optional[list[tuple[int, int, int]]]:
        """(dim, start, stop) for each dimension of a tensor of `shape` the region does not hold
        whole, [] for all of it, [(-1, start, stop)] for elements [start, stop) of its row-major
        order (a ZeRO slice of the whole tensor); None for a slice of a box. A tensor whose
        savers' cuts tile it evenly is marked so in the head (commit.even_split)."""
        cut = [(d, o, o + s) for d, (o, s, n) in enumerate(zip(self.offsets, self.sizes, shape)) if (o, s) != (0, n)]
        if self.flat is not None:
            return [(-1, *self.flat)] if not cut else None
        return cut

    def extent(self, dim: int, shape: tuple[int, ...]) -> tuple[int, int]:
        """[lo, hi) the region spans along dimension `dim` of a tensor of `shape` (dim -1: of
        its row-major order), for finding the saved slabs it meets."""
        if dim >= 0:
            return self.offsets[dim], self.offsets[dim] + self.sizes[dim]
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        firsts = [sum(o * t for o, t in zip(p.offsets, strides)) for p in self.pieces()]
        lasts = [sum((o + s - 1) * t for o, s, t in zip(p.offsets, p.sizes, strides)) for p in self.pieces()]
        return min(firsts), max(lasts) + 1

    def to_json(self) -> dict:
        out = {"offsets": list(self.offsets), "sizes": list(self.sizes)}
        if self.flat:
            out["flat"] = list(self.flat)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Region":
        flat = data.get("flat")
        return cls(tuple(data["offsets"]), tuple(data["sizes"]), tuple(flat) if flat else None)


def _flat_to_boxes(shape: tuple[int, ...], a: int, b: int) -> list[SubBox]:
    """Elements [a, b) of a row-major `shape` as contiguous boxes (offsets local to shape)."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [SubBox((a,), (b - a,), a)] if shape else [SubBox((), (), 0)]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if i0 == i1:                                    # inside one row-block
        return [SubBox((i0,) + p.offsets, (1,) + p.sizes, i0 * inner + p.start)
                for p in _flat_to_boxes(rest, r0, r1)]
    out = []
    if r0:                                          # partial first row-block
        out += [SubBox((i0,) + p.offsets, (1,) + p.sizes, i0 * inner + p.start)
                for p in _flat_to_boxes(rest, r0, inner)]
        i0 += 1
    if i1 > i0:                                     # whole row-blocks
        out.append(SubBox((i0,) + zeros, (i1 - i0,) + rest, i0 * inner))
    if r1:                                          # partial last row-block
        out += [SubBox((i1,) + p.offsets, (1,) + p.sizes, i1 * inner + p.start)
                for p in _flat_to_boxes(rest, 0, r1)]
    return out


def intersect(a_off, a_size, b_off, b_size) -> Optional[Box]:
    """The overlap of two boxes, or None. (Plain loops: a load plans a few of these per piece.)"""
    lo, sizes = [], []
    for x, s, y, t in zip(a_off, a_size, b_off, b_size):
        start, stop = x if x > y else y, min(x + s, y + t)
        if stop <= start:
            return None
        lo.append(start)
        sizes.append(stop - start)
    return tuple(lo), tuple(sizes)


def local_slices(box: Box, within: SubBox) -> tuple[slice, ...]:
    """numpy index of `box` inside the array of sub-box `within`."""
    return tuple(slice(o - w, o - w + s) for o, s, w in zip(box[0], box[1], within.offsets))


def byte_run(box: Box, within: SubBox, itemsize: int) -> Optional[tuple[int, int]]:
    """Bytes [start, end) of `box` relative to the first byte of sub-box `within`, when the box
    is one contiguous run of it (every dimension after the first partial one is whole and
    every one before it has size 1); None otherwise."""
    offsets, sizes = box
    start, stride, count, whole = 0, 1, 1, True
    for d in reversed(range(len(sizes))):       # innermost first: whole dims, one partial, then 1s
        n = sizes[d]
        if not whole and n != 1:
            return None
        whole = whole and n == within.sizes[d]
        start += (offsets[d] - within.offsets[d]) * stride
        stride *= within.sizes[d]
        count *= n
    return start * itemsize, (start + count) * itemsize
