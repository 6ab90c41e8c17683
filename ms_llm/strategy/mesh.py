"""Named device meshes and the pure rank arithmetic behind them.

Rank order (outermost to innermost, row-major like torch's DeviceMesh):

    pp - dp_replicate - dp_shard - cp - tp

so tp neighbours are adjacent ranks (fastest links) and pipeline stages are the farthest
apart. This is Megatron-LM's order "tp-cp-ep-dp-pp" (written innermost first) and
torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp]; converters need no rank remap.
Expert layers use the same ranks regrouped (Megatron-core's MoE parallel folding): each
stage's dp * cp * tp ranks, in order, read as (edp, ep, etp) with etp innermost, Megatron's
expert rank order "tp-ep-dp-pp" (expert_mesh). With etp = tp this is dp * cp split into
(edp, ep) beside tp, as MindFormers' MoE (dp' = dp*cp/ep) does; with etp = 1, ep may take
tensor-parallel ranks too, as MindFormers 2.x's grouped-GEMM experts ((dp*tp/ep, ep)) do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ms_llm.errors import StrategyError

DENSE_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Expert layers: expert data parallel (ranks holding the same expert shard), expert parallel
# (ranks splitting the experts), expert tensor parallel (ranks splitting each expert's width).
EXPERT_AXES: tuple[str, ...] = ("pp", "edp", "ep", "etp")
# Flattened axes: a name for every group a backend needs (the data-parallel gradient
# reduction spans dp and cp because cp ranks hold the same parameters).
DERIVED_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
}


def rank_to_coords(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinates of `rank`.

    >>> rank_to_coords(5, (2, 2, 2))   # 5 = 1*4 + 0*2 + 1
    (1, 0, 1)
    """
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def coords_to_rank(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    rank = 0
    for c, size in zip(coords, shape):
        rank = rank * size + c
    return rank


def rank_groups(shape: tuple[int, ...], vary: tuple[int, ...]) -> list[list[int]]:
    """Groups of ranks that differ only along the mesh dimensions `vary`.

    Worked example, 8 ranks as (pp, dp, tp) = (2, 2, 2):
      tp groups (vary=(2,)):   [0,1] [2,3] [4,5] [6,7]
      dp groups (vary=(1,)):   [0,2] [1,3] [4,6] [5,7]
      pp groups (vary=(0,)):   [0,4] [1,5] [2,6] [3,7]
      dp x tp   (vary=(1,2)):  [0,1,2,3] [4,5,6,7]
    Ranks inside a group are ordered row-major over the varying dimensions.
    >>> rank_groups((2, 2, 2), (1,))
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    fixed = [d for d in range(len(shape)) if d not in vary]
    fixed_shape = tuple(shape[d] for d in fixed)
    vary_shape = tuple(shape[d] for d in vary)
    groups = []
    for f in range(math.prod(fixed_shape)):
        fc = rank_to_coords(f, fixed_shape)
        group = []
        for v in range(math.prod(vary_shape)):
            vc = rank_to_coords(v, vary_shape)
            coords = [0] * len(shape)
            for d, c in zip(fixed, fc):
                coords[d] = c
            for d, c in zip(vary, vc):
                coords[d] = c
            group.append(coords_to_rank(tuple(coords), shape))
        groups.append(group)
    return groups


def expert_mesh(pp: int, stage_size: int, ep: int, etp: int) -> "MeshSpec":
    """The expert layers' mesh: the same ranks as the dense mesh, each stage's `stage_size` =
    dp * cp * tp ranks read in order as (edp, ep, etp), etp innermost.

    Worked example, one stage of 8 ranks as dense (dp, tp) = (2, 4), experts ep4 x etp2 (edp 1):
      dense tp groups   [0,1,2,3] [4,5,6,7]      dense dp groups  [0,4] [1,5] [2,6] [3,7]
      etp groups        [0,1] [2,3] [4,5] [6,7]  ep groups        [0,2,4,6] [1,3,5,7]
    each expert's width is split over tp neighbours, and the experts over both dp replicas.
    >>> m = expert_mesh(1, 8, 4, 2)
    >>> m.groups("etp"), m.groups("ep")
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    """
    if stage_size % (ep * etp):
        raise StrategyError(f"mesh: ep*etp = {ep}*{etp} does not divide the {stage_size} ranks of a stage")
    return MeshSpec(EXPERT_AXES, (pp, stage_size // (ep * etp), ep, etp))


@dataclass(frozen=True)
class MeshSpec:
    """A named mesh: axis names (outermost first) and sizes. Ranks are row-major."""
    names: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shape):
            raise StrategyError(f"mesh: {len(self.names)} names for {len(self.shape)} sizes")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return math.prod(self.shape[self.names.index(a)] for a in self.expand(name))

    def expand(self, name: str) -> tuple[str, ...]:
        """The base axes a (possibly derived) axis name stands for."""
        if name in self.names:
            return (name,)
        if name in DERIVED_AXES and all(a in self.names for a in DERIVED_AXES[name]):
            return DERIVED_AXES[name]
        raise StrategyError(f"mesh: no axis {name!r}; axes are {', '.join(self.names)}")

    def coords(self, rank: int) -> dict[str, int]:
        return dict(zip(self.names, rank_to_coords(rank, self.shape)))

    def rank(self, **coords: int) -> int:
        return coords_to_rank(tuple(coords.get(n, 0) for n in self.names), self.shape)

    def groups(self, name: str) -> list[list[int]]:
        """All rank groups of axis `name` (derived names allowed), each ordered along it."""
        dims = tuple(self.names.index(a) for a in self.expand(name))
        return rank_groups(self.shape, dims)

    def group_of(self, name: str, rank: int) -> list[int]:
        return next(g for g in self.groups(name) if rank in g)

    def index_in(self, name: str, rank: int) -> int:
        """Position of `rank` along (possibly derived) axis `name`."""
        return self.group_of(name, rank).index(rank)

    def without(self, *names: str) -> "MeshSpec":
        keep = [i for i, n in enumerate(self.names) if n not in names]
        return MeshSpec(tuple(self.names[i] for i in keep), tuple(self.shape[i] for i in keep))

    def describe(self) -> str:
        return " x ".join(f"{n}{s}" for n, s in zip(self.names, self.shape))
