"""ZeroPlan: the partition of one ModelPlan, queryable per rank.

Pure functions of (ModelPlan, rank): checkpoint code asks `owned(rank)` / `owners(name)`
which elements a rank holds, engines ask for buckets, groups and the collective schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ms_llm.config.model import DTYPE_BYTES
from ms_llm.errors import StrategyError
from ms_llm.strategy.cost import ADAM_STATE_BYTES
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.mesh import DENSE_AXES, MeshSpec
from ms_llm.strategy.plan import ModelPlan, ZeroPartition, zero_partition
from ms_llm.zero.partition import (
    Bucket, FlatBuffer, ParamEntry, Slot, Unit, build_buckets, embedding_groups, entries_from_plan, entries_from_shapes,
    zero_groups)
from ms_llm.zero.schedule import Collective, grad_collectives, param_collectives


@dataclass(frozen=True)
class OwnedPiece:
    """Elements of one parameter a rank holds in one bucket segment.

    The segment range [start, start + numel) of buffer `buffer` holds the box `local_box`
    of the rank's TP-local tensor, row-major; `global_box` is the same box in the full
    tensor (for a sharded piece it equals the parameter's zero_layout.shard_box). When
    `contiguous`, the box is the flat range [local_offset, local_offset + numel) of the
    TP-local tensor. `primary` marks exactly one rank among all ranks holding identical
    copies (replicas across dp_replicate, tp-replicated parameters, replicated buckets, the
    embedding's tied copy on another pipeline stage): the one a checkpoint writer or a norm
    computation should count.
    """
    name: str
    rank: int
    buffer: int
    bucket: int
    start: int
    numel: int
    local_box: tuple[tuple[int, ...], tuple[int, ...]]
    global_box: tuple[tuple[int, ...], tuple[int, ...]]
    local_offset: int
    contiguous: bool
    primary: bool


@dataclass(frozen=True)
class ZeroPlan:
    stage: int
    mesh: MeshSpec
    zero: ZeroPartition
    entries: tuple[ParamEntry, ...]
    buffers: tuple[FlatBuffer, ...]
    buckets: tuple[Bucket, ...]
    units: tuple[Unit, ...]
    groups: dict[str, list[list[int]]]   # shard, replicate, dp, embedding (ranks of the tied entries);
                                         # expert_shard, expert_dp with routed experts (over edp)
    dp_cp_size: int                # ranks whose gradients are averaged (the experts' too: their mean is
                                   # over the same tokens, though edp ranks alone hold the same expert)
    expert_zero: Optional[ZeroPartition] = None    # the routed experts' partition (over edp)

    # ---- ranks and groups ------------------------------------------------------------
    def pipeline_stage(self, rank: int) -> int:
        return self.mesh.coords(rank)["pp"]

    def group_of(self, kind: str, rank: int) -> list[int]:
        return next(g for g in self.groups[kind] if rank in g)

    def shard_index(self, rank: int) -> int:
        """Which segment of every sharded dense bucket `rank` owns."""
        return self.group_of("shard", rank).index(rank)

    def group_kind(self, bucket: Bucket, kind: str) -> str:
        """The groups entry a collective of `kind` (shard, replicate, dp) over `bucket` runs on."""
        return f"expert_{kind}" if bucket.expert else kind

    def segment_index(self, rank: int, bucket: Bucket) -> int:
        """The segment of `bucket` that `rank` owns (0 in a replicated bucket)."""
        if not bucket.sharded:
            return 0
        return self.group_of(self.group_kind(bucket, "shard"), rank).index(rank)

    # ---- what lives on a rank ----------------------------------------------------------
    def buckets_of(self, rank: int) -> tuple[Bucket, ...]:
        stage = self.pipeline_stage(rank)
        return tuple(b for b in self.buckets if self.buffers[b.buffer].stage == stage)

    def units_of(self, rank: int) -> tuple[Unit, ...]:
        """Gather units of the rank's pipeline stage in forward order."""
        stage = self.pipeline_stage(rank)
        return tuple(u for u in self.units if u.stage == stage)

    def entry(self, name: str, stage: Optional[int] = None) -> ParamEntry:
        """The parameter's entry (on pipeline stage `stage`, where a tied copy shares its name)."""
        return next(e for e in self.entries if e.name == name and stage in (None, e.stage))

    def tied_names(self) -> frozenset[str]:
        """Parameters with a tied copy, whose gradients the engine sums over groups['embedding']."""
        return frozenset(e.name for e in self.entries if e.tied)

    def slot(self, name: str) -> tuple[Bucket, Slot]:
        for b in self.buckets:
            for s in b.slots:
                if s.name == name:
                    return b, s
        raise KeyError(name)

    def check_dtypes(self, actual: dict[str, str]) -> None:
        """Raise if a parameter's dtype (name -> dtype name, as the model holds it) is not the
        one its buffer was planned in."""
        for b in self.buckets:
            want = self.buffers[b.buffer].dtype
            for s in b.slots:
                got = actual.get(s.name)
                if got is not None and got != want:
                    raise StrategyError(
                        f"strategy.precision.param_dtype: the ZeRO plan keeps {s.name} in {want} but the model "
                        f"holds it in {got}; cast the model to {want} or set precision.param_dtype: {got}")

    def grad_collectives(self, bucket: Bucket) -> tuple[Collective, ...]:
        """Group names are the dense kinds; group_kind maps them to the bucket's own."""
        replicas = 1 if bucket.expert else len(self.groups["replicate"][0])
        return grad_collectives(self.stage, bucket.sharded, replicas)

    def param_collectives(self, bucket: Bucket) -> tuple[Collective, ...]:
        return param_collectives(self.stage, bucket.sharded)

    # ---- ownership ---------------------------------------------------------------------
    def _is_primary(self, entry: ParamEntry, sharded: bool, rank: int) -> bool:
        """At coordinate 0 of every axis of the entry's stage mesh (the dense one, or the experts'
        (edp, ep, etp)) that neither its layout nor, in a sharded bucket, its ZeRO axes split."""
        if entry.tied:
            return False
        zero = self.expert_zero if entry.expert else self.zero
        split = {a for d in range(len(entry.layout.shape)) for a in entry.layout.axes_of(d)}
        if sharded:
            split |= set(zero.axes)
        coords = entry.layout.mesh.coords(self._stage_rank(rank))
        return all(c == 0 for a, c in coords.items() if a not in split)

    def pieces(self, rank: int, bucket: Bucket) -> tuple[OwnedPiece, ...]:
        """The pieces of `bucket` that `rank` holds after a reduce-scatter / before an all-gather."""
        index = self.segment_index(rank, bucket)
        stage_rank = self._stage_rank(rank)
        buf_start = bucket.start + index * bucket.segment
        out = []
        stage = self.buffers[bucket.buffer].stage
        for s in bucket.slots:
            entry = self.entry(s.name, stage)
            box = s.piece_box(index)
            tp_offsets, _ = entry.layout.shard_box(stage_rank)
            global_box = (tuple(a + b for a, b in zip(tp_offsets, box[0])), box[1])
            contiguous = s.zero_dim is None or all(n == 1 for n in s.local_shape[:s.zero_dim])
            local_offset = _flat_offset(s.local_shape, box[0])
            out.append(OwnedPiece(s.name, rank, bucket.buffer, bucket.index, buf_start + s.offset, s.numel,
                                  box, global_box, local_offset, contiguous,
                                  self._is_primary(entry, bucket.sharded, rank)))
        return tuple(out)

    def owned(self, rank: int) -> tuple[OwnedPiece, ...]:
        """Every piece `rank` holds (its optimizer states, and its parameter / gradient
        shards from stage 2 / 3 on), in buffer order."""
        return tuple(p for b in self.buckets_of(rank) for p in self.pieces(rank, b))

    def owners(self, name: str) -> tuple[OwnedPiece, ...]:
        """Every rank's piece of parameter `name` (all ranks of its pipeline stage)."""
        bucket, _ = self.slot(name)
        stage = self.buffers[bucket.buffer].stage
        ranks = [r for r in range(self.mesh.size) if self.pipeline_stage(r) == stage]
        return tuple(p for r in ranks for p in self.pieces(r, bucket) if p.name == name)

    def _stage_rank(self, rank: int) -> int:
        coords = self.mesh.coords(rank)
        stage_mesh = self.mesh.without("pp")
        return stage_mesh.rank(**{n: coords[n] for n in stage_mesh.names})

    # ---- memory ------------------------------------------------------------------------
    def model_state_bytes(self, rank: int, optimizer: str, master_dtype: Optional[str] = None,
                          experts: Optional[bool] = None) -> dict[str, int]:
        """Bytes of params, grads and optimizer states the engine keeps on `rank` at the end
        of backward (padding included): the exact counterpart of cost.zero_model_state_bytes.
        `experts` True / False: of the routed experts' buckets / of the others only."""
        params = grads = optim = 0
        per_elem = ADAM_STATE_BYTES if optimizer == "adamw" else 0
        if master_dtype is not None:
            per_elem += DTYPE_BYTES[master_dtype]
        for b in self.buckets_of(rank):
            if experts is not None and b.expert != experts:
                continue
            item = DTYPE_BYTES[self.buffers[b.buffer].dtype]
            unpadded = sum(s.numel * s.parts for s in b.slots)
            params += item * (b.segment if self.stage >= 3 and b.sharded else unpadded)
            grads += item * (b.segment if self.stage >= 2 else b.numel)
            optim += per_elem * b.segment
        return {"params": params, "grads": grads, "optimizer": optim}


def _flat_offset(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    flat = 0
    for size, off in zip(shape, offsets):
        flat = flat * size + off
    return flat


def zero_plan(plan: ModelPlan) -> ZeroPlan:
    """The partition both backends execute for `plan` (its strategy.zero stage, bucket_mb), the
    routed experts' over edp (plan.expert_zero) beside the dense parameters'."""
    entries = entries_from_plan(plan)
    return build_zero_plan(entries, plan.mesh, plan.zero, plan.strategy.zero.bucket_mb, plan.expert_mesh,
                           plan.expert_zero)


def build_zero_plan(entries: list[ParamEntry], mesh: MeshSpec, zero: ZeroPartition, bucket_mb: float,
                    expert_mesh: Optional[MeshSpec] = None, expert_zero: Optional[ZeroPartition] = None) -> ZeroPlan:
    experts = expert_zero.group_size if expert_zero is not None else 1
    buffers, buckets, units = build_buckets(entries, zero.group_size, bucket_mb, zero.stage, experts)
    dp_cp = 1
    for a in ("dp_replicate", "dp_shard", "cp"):
        dp_cp *= mesh.axis_size(a)
    tied = {e.name for e in entries if e.tied}
    groups = zero_groups(mesh, zero, expert_mesh, expert_zero)
    groups["embedding"] = embedding_groups(mesh, tuple(sorted({e.stage for e in entries if e.name in tied})))
    return ZeroPlan(zero.stage, mesh, zero, tuple(entries), buffers, buckets, units, groups, dp_cp, expert_zero)


def zero_plan_for_params(params: list[tuple[str, tuple[int, ...], str, str]], strategy: ParallelStrategy,
                         world_size: int, dtype: str) -> ZeroPlan:
    """The partition of a data-parallel-only model given as (name, shape, unit, module)."""
    s = strategy.resolve(world_size)
    if s.model_parallel_size != 1:
        raise StrategyError("strategy: a model given by parameter shapes runs data parallel only; "
                            "set tp, pp and cp to 1 or plan it as a LLaMA model")
    mesh = MeshSpec(DENSE_AXES, (1, s.dp_replicate, s.dp_shard, 1, 1))
    zero = zero_partition(s, mesh)
    return build_zero_plan(entries_from_shapes(params, mesh, zero, dtype), mesh, zero, s.zero.bucket_mb)
