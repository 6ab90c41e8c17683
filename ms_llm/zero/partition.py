"""ZeRO partition: parameters -> flat buffers -> buckets -> per-rank segments.

Both backends build this from the same ModelPlan, so they agree element for element on
who owns what (a ZeRO checkpoint written by one loads on the other).

Layout of one bucket (rank-major, like FSDP2's all-gather buffer): the bucket holds
`parts` segments of `segment` elements, one per rank of the shard group, in group order.
Segment r holds, for every parameter of the bucket in order, chunk r of the parameter's
TP-local tensor along its ZeRO dimension (the ModelPlan's `zero_layout`), flattened
row-major, then zero padding up to an aligned length. A reduce-scatter of the bucket leaves
each rank its own segment; an all-gather rebuilds the whole bucket. A parameter whose
dimensions the shard group does not divide (the plan leaves its zero_layout unsplit) goes
to a replicated bucket (parts = 1): all-reduced and updated whole on every rank.

The routed experts (MoE) live on the expert mesh (edp, ep, etp) and are partitioned over edp, the
ranks holding the same expert shard (the plan's expert_zero): their buckets are apart from the dense
ones and reduce, gather and broadcast over the expert groups (expert_shard, expert_dp).

Worked example, group of 2, bucket [a (4x2, dim 0), b (2,)]:
    segment 0 = a[0:2].flat (4) + b[0:1] (1) + padding,  segment 1 = a[2:4].flat + b[1:2] + padding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ms_llm.config.model import DTYPE_BYTES
from ms_llm.strategy.layout import Shard, TensorLayout
from ms_llm.strategy.mesh import MeshSpec, rank_groups
from ms_llm.strategy.plan import EXPERT_KINDS, ModelPlan, ZeroPartition, zero_layout

ALIGN_BYTES = 64            # each rank segment starts on a 64-byte boundary of its bucket
DP_AXES = ("dp_replicate", "dp_shard", "cp")   # ranks holding the same parameters
EMBEDDING = "model.embed_tokens.weight"          # copied to the MTP modules' pipeline stage


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as the partitioner sees it (built from a ParamPlan)."""
    name: str
    layout: TensorLayout           # tensor-parallel layout over the stage mesh
    zero_dim: Optional[int]        # dim of the TP-local tensor the shard group splits; None = kept whole
    stage: int
    chunk: int
    unit: str                      # ZeRO-3 gather unit: 'embed', 'layer.N', 'final'
    module: str                    # FQN of the module whose forward reads the parameter
    dtype: str
    # A copy of a parameter another pipeline stage holds (the embedding the MTP modules read on
    # their stage, Megatron-core's embedding group): the engine sums its gradient with the
    # original's over groups["embedding"]; it counts in no norm and no checkpoint (not primary).
    tied: bool = False
    # A routed expert: its layout is over the expert mesh, its zero_dim splits it over edp.
    expert: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.layout.local_shape()

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits inside its bucket's segments."""
    name: str
    local_shape: tuple[int, ...]
    zero_dim: Optional[int]
    parts: int                     # shard group size for sharded buckets, 1 for replicated ones
    offset: int                    # element offset of the parameter's piece inside every segment
    numel: int                     # elements of the piece (local numel / parts)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape of the piece each segment holds (the TP-local shape, split along zero_dim)."""
        shape = list(self.local_shape)
        if self.zero_dim is not None:
            shape[self.zero_dim] //= self.parts
        return tuple(shape)

    def piece_box(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the TP-local tensor of the piece segment `index` holds."""
        sizes, offsets = self.piece_shape, [0] * len(self.local_shape)
        if self.zero_dim is not None:
            offsets[self.zero_dim] = index * sizes[self.zero_dim]
        return tuple(offsets), sizes


@dataclass(frozen=True)
class Bucket:
    """A run of parameters reduced (and gathered) by one collective."""
    index: int
    buffer: int
    start: int                     # element offset of the bucket in its flat buffer
    parts: int                     # segments (= shard group size), 1 = replicated bucket
    segment: int                   # elements per segment, padding included
    slots: tuple[Slot, ...]
    units: tuple[str, ...]         # gather units it serves (exactly one under ZeRO-3)
    expert: bool = False           # routed experts: its collectives run over the expert groups

    @property
    def numel(self) -> int:
        return self.parts * self.segment

    @property
    def sharded(self) -> bool:
        return self.parts > 1

    @property
    def padding(self) -> int:
        return self.segment - sum(s.numel for s in self.slots)


@dataclass(frozen=True)
class FlatBuffer:
    """All buckets of one (pipeline stage, model chunk, dtype), back to back."""
    index: int
    stage: int
    chunk: int
    dtype: str
    buckets: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class Unit:
    """Parameters gathered together before use under ZeRO-3 (one decoder layer, the
    embedding, or final norm + head) and the modules whose forward needs them."""
    name: str
    stage: int
    chunk: int
    modules: tuple[str, ...]
    params: tuple[str, ...]
    buckets: tuple[int, ...]


def align_elements(dtype: str) -> int:
    return max(1, ALIGN_BYTES // DTYPE_BYTES[dtype])


def zero_dim(entry_layout: TensorLayout, zero_layout: TensorLayout, axes: tuple[str, ...]) -> Optional[int]:
    """The TP-local dimension the ZeRO axes split in `zero_layout`, or None."""
    if not axes or zero_layout == entry_layout:
        return None
    p = zero_layout.placements[zero_layout.mesh.names.index(axes[0])]
    return p.dim if isinstance(p, Shard) else None


def entries_from_plan(plan: ModelPlan) -> list[ParamEntry]:
    """Parameters in model order (embedding, layers with their experts, final norm, head, MTP
    modules) with their units, then the embedding's copy on the MTP modules' stage
    (ModelPlan.embedding_stages), in its final unit, whose modules read it."""
    dtype = plan.strategy.precision.param_dtype
    out = []
    for p in plan.params.values():
        if p.layer is not None:
            unit, module = f"layer.{p.layer}", f"model.layers.{p.layer}"
        elif p.kind == "embedding":
            unit, module = "embed", p.name.rsplit(".", 1)[0]
        else:
            unit, module = "final", p.name.rsplit(".", 1)[0]
        expert = p.kind in EXPERT_KINDS
        axes = plan.expert_zero.axes if expert else plan.zero.axes
        out.append(ParamEntry(p.name, p.layout, zero_dim(p.layout, p.zero_layout, axes),
                              p.stage, p.chunk, unit, module, dtype, expert=expert))
    embed = plan.params.get(EMBEDDING)
    for chunk in plan.chunks:
        if embed is not None and chunk.has_mtp and chunk.stage != embed.stage:
            out.append(ParamEntry(EMBEDDING, embed.layout, zero_dim(embed.layout, embed.zero_layout, plan.zero.axes),
                                  chunk.stage, chunk.index, "final", EMBEDDING.rsplit(".", 1)[0], dtype, tied=True))
    return out


def entries_from_shapes(params: list[tuple[str, tuple[int, ...], str, str]], mesh: MeshSpec,
                        zero: ZeroPartition, dtype: str) -> list[ParamEntry]:
    """Entries for a model outside the LLaMA plan (name, shape, unit, module), one pipeline
    stage, no tensor parallel: the same ZeRO layout rule as the ModelPlan's."""
    stage_mesh = mesh.without("pp")
    out = []
    for name, shape, unit, module in params:
        layout = TensorLayout.replicated(tuple(shape), stage_mesh)
        out.append(ParamEntry(name, layout, zero_dim(layout, zero_layout(layout, zero), zero.axes),
                              0, 0, unit, module, dtype))
    return out


def _bucket_capacity(bucket_mb: float, dtype: str) -> int:
    return int(bucket_mb * 2 ** 20) // DTYPE_BYTES[dtype]


def build_buckets(entries: list[ParamEntry], group_size: int, bucket_mb: float, stage: int,
                  expert_group_size: int = 1) -> tuple[tuple[FlatBuffer, ...], tuple[Bucket, ...], tuple[Unit, ...]]:
    """Group `entries` (in their given order) into buffers and buckets; sharded buckets split
    over `group_size` ranks, the routed experts' over `expert_group_size` (edp).

    A new bucket starts when the next parameter would push the bucket past bucket_mb (a
    parameter larger than that gets a bucket of its own; 0 = one parameter per bucket),
    when it changes between sharded and replicated or between dense and expert, and under
    ZeRO-3 at every unit edge, so one unit's gather never waits on another's parameters.
    """
    keys: list[tuple[int, int, str]] = []
    for e in entries:
        key = (e.stage, e.chunk, e.dtype)
        if key not in keys:
            keys.append(key)
    keys.sort(key=lambda k: (k[0], k[1]))
    buffers, buckets = [], []
    for b_index, key in enumerate(keys):
        members = [e for e in entries if (e.stage, e.chunk, e.dtype) == key]
        capacity = _bucket_capacity(bucket_mb, key[2])
        runs: list[list[ParamEntry]] = []
        for e in members:
            if runs:
                last = runs[-1]
                same_kind = (last[-1].zero_dim is None) == (e.zero_dim is None) and last[-1].expert == e.expert
                same_unit = stage < 3 or last[-1].unit == e.unit
                fits = sum(x.local_numel for x in last) + e.local_numel <= capacity
                if same_kind and same_unit and fits:
                    last.append(e)
                    continue
            runs.append([e])
        start, ids = 0, []
        align = align_elements(key[2])
        for run in runs:
            parts = (expert_group_size if run[0].expert else group_size) if run[0].zero_dim is not None else 1
            slots, offset = [], 0
            for e in run:
                n = e.local_numel // parts
                slots.append(Slot(e.name, e.local_shape, e.zero_dim, parts, offset, n))
                offset += n
            segment = -(-offset // align) * align
            units = tuple(dict.fromkeys(e.unit for e in run))
            bucket = Bucket(len(buckets), b_index, start, parts, segment, tuple(slots), units, run[0].expert)
            buckets.append(bucket)
            ids.append(bucket.index)
            start += bucket.numel
        buffers.append(FlatBuffer(b_index, key[0], key[1], key[2], tuple(ids), start))
    units = []
    for name in dict.fromkeys(e.unit for e in entries):
        members = [e for e in entries if e.unit == name]
        held = {(e.name, e.stage) for e in members}        # a tied copy's name is its original's
        units.append(Unit(name, members[0].stage, members[0].chunk,
                          tuple(dict.fromkeys(e.module for e in members)), tuple(e.name for e in members),
                          tuple(b.index for b in buckets
                                if any((s.name, buffers[b.buffer].stage) in held for s in b.slots))))
    return tuple(buffers), tuple(buckets), tuple(units)


def zero_groups(mesh: MeshSpec, zero: ZeroPartition, expert_mesh: Optional[MeshSpec] = None,
                expert_zero: Optional[ZeroPartition] = None) -> dict[str, list[list[int]]]:
    """Rank groups (global ranks) the engine's collectives run over.

    shard: ranks splitting one bucket (reduce-scatter / all-gather);
    replicate: ranks holding the same segment (all-reduce after the reduce-scatter, HSDP);
    dp: every rank holding the same parameters (all-reduce of replicated buckets);
    expert_shard, expert_dp (MoE): the same for the routed experts' buckets, over edp.
    """
    def groups(m: MeshSpec, axes: tuple[str, ...]) -> list[list[int]]:
        return rank_groups(m.shape, tuple(m.names.index(a) for a in axes))

    replicate = tuple(a for a in DP_AXES if a not in zero.axes)
    out = {"shard": groups(mesh, zero.axes), "replicate": groups(mesh, replicate), "dp": groups(mesh, DP_AXES)}
    if expert_mesh is not None:
        out.update(expert_shard=groups(expert_mesh, expert_zero.axes), expert_dp=groups(expert_mesh, ("edp",)))
    return out


def embedding_groups(mesh: MeshSpec, stages: tuple[int, ...]) -> list[list[int]]:
    """Megatron-core's embedding groups: for each position of the stage mesh, its ranks on the
    pipeline stages `stages` that hold the embedding (ModelPlan.embedding_stages); none with
    fewer than two such stages.

    Worked example, 8 ranks as (pp, dp) = (4, 2), stages (0, 3): [0, 6] [1, 7].
    >>> embedding_groups(MeshSpec(("pp", "dp_shard"), (4, 2)), (0, 3))
    [[0, 6], [1, 7]]
    """
    if len(stages) < 2:
        return []
    return [[g[s] for s in stages] for g in rank_groups(mesh.shape, (mesh.names.index("pp"),))]
