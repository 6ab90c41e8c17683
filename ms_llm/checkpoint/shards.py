"""Which piece of which tensor a rank holds, read off the ModelPlan.

A Piece names a global tensor, the Region of it a rank holds and whether this rank is the
one copy that gets written (`primary`: among ranks holding the same piece, the one at
coordinate 0 of every mesh axis that does not split the tensor). Saving and loading both
speak in Pieces, so a backend only pairs its local tensors with them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.format import optim_name
from ms_llm.errors import CheckpointError
from ms_llm.strategy.layout import Partial, Shard, TensorLayout


@dataclass(frozen=True)
class Piece:
    name: str
    shape: tuple[int, ...]          # the global tensor
    region: Region
    primary: bool = True
    layout: str = ""                # TensorLayout.describe() it came from, for the index

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.region.shape


def layout_piece(name: str, layout: TensorLayout, mesh_rank: int) -> Piece:
    """The piece mesh-rank `mesh_rank` of `layout.mesh` holds."""
    if layout.partial_axes:
        raise CheckpointError(f"{name}: a partial sum over {layout.partial_axes} cannot be saved; reduce it first")
    offsets, sizes = layout.shard_box(mesh_rank)
    coords = layout.mesh.coords(mesh_rank)
    primary = all(coords[a] == 0 for a, p in zip(layout.mesh.names, layout.placements)
                  if not isinstance(p, (Shard, Partial)))
    return Piece(name, layout.shape, Region(offsets, sizes), primary, layout.describe())


def param_pieces(plan, rank: int, names: Iterable[str] | None = None) -> dict[str, Piece]:
    """Pieces of the model weights on global `rank` where they rest between steps (the plan's
    stored_layout: ZeRO-3 shards, else the tensor-parallel layout). Only the rank's stage."""
    stage = plan.mesh.coords(rank)["pp"]
    srank = plan.stage_rank(rank)
    out = {}
    for p in plan.params.values():
        if p.stage != stage or (names is not None and p.name not in names):
            continue
        out[p.name] = layout_piece(p.name, p.stored_layout, srank)
    return out


def optim_pieces(plan, rank: int, states: Sequence[str]) -> dict[str, Piece]:
    """Pieces of optimizer states (exp_avg, exp_avg_sq, master, ...) on `rank`, where the
    plan's optimizer_layout puts them (ZeRO-1+ shards, else the tensor-parallel layout)."""
    stage = plan.mesh.coords(rank)["pp"]
    srank = plan.stage_rank(rank)
    out = {}
    for p in plan.params.values():
        if p.stage != stage:
            continue
        for state in states:
            name = optim_name(state, p.name)
            out[name] = layout_piece(name, p.optimizer_layout, srank)
    return out


def flat_pieces(members: Sequence[tuple[Piece, int]], start: int, stop: int) -> list[Piece]:
    """Map a ZeRO flat-buffer slice [start, stop) back to named tensors.

    `members` lists, in buffer order, each tensor's piece (the region the buffer holds of
    it, normally the tensor-parallel piece) and its element offset in the buffer; padding
    between or after members is skipped. Returns one flat Piece per member the slice
    touches, carrying the member's primary flag."""
    out = []
    for piece, offset in members:
        if piece.region.flat:
            raise CheckpointError(f"{piece.name}: a flat-buffer member must be a whole box, got a flat region")
        a, b = max(start, offset), min(stop, offset + piece.region.numel)
        if a < b:
            region = Region(piece.region.offsets, piece.region.sizes, (a - offset, b - offset))
            out.append(Piece(piece.name, piece.shape, region, piece.primary, piece.layout))
    return out
