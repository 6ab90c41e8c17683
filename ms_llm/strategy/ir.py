"""ParallelStrategy: the backend-neutral description of how a job is split over devices.

Degrees use "1 means off". `dp = -1` means "the ranks left over" once tp, pp and cp are
placed, resolved by `resolve(world_size)`. Rules that involve the model or the batch are
checked in validate.py; this file only holds the values.

Expert layers fold the same ranks differently (Megatron-core's MoE parallel folding): within
a pipeline stage, attention splits the dp * cp * tp ranks as (dp, cp, tp) and the routed
experts as (edp, ep, etp), ep * etp * edp = dp * cp * tp. `etp = -1` (the default) is tp, as
Megatron's --expert-tensor-parallel-size defaults to tp: each expert's width is split like the
dense MLP's and ep is carved out of dp * cp, which is what every strategy meant before etp
existed. `etp: 1` keeps each expert whole, and ep may then take tensor-parallel ranks too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from ms_llm.config.schema import spec
from ms_llm.config.model import MAX_LAYERS, DType
from ms_llm.errors import StrategyError

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# Schedules that place several model chunks on one rank.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zbv")
# Devices in one job: past the largest clusters built, and small enough that per-rank tables stay cheap.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ZeroSpec:
    stage: int = spec(0, "0: replicated (DDP); 1: shard optimizer states; 2: + gradients; 3: + parameters.",
                      ge=0, le=3)
    shard_size: int = spec(-1, "Ranks a shard group spans (HSDP: shard inside, replicate across); "
                               "-1 = all of dp.", ge=-1, le=MAX_WORLD_SIZE)
    bucket_mb: float = spec(25.0, "Gradient / parameter bucket size for fused collectives.", ge=0.0,
                          le=1 << 20)
    engine: Literal["auto", "shared", "native"] = spec(
        "auto", "'shared': ms_llm's ZeRO engine (same partition on both backends); 'native': the "
                "backend's own (torch DDP / FSDP2 fully_shard, MindSpore parallel optimizer); "
                "'auto' = shared where the backend has it.")

    def __post_init__(self) -> None:
        if self.shard_size == 0:
            raise StrategyError("strategy.zero.shard_size: 0 is not a group size; use -1 (all of dp) or a divisor of dp")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    schedule: Schedule = spec("1f1b", "Pipeline schedule (ignored when pp = 1).")
    virtual_stages: int = spec(1, "Model chunks per pipeline rank (interleaved / V schedules).", ge=1,
                                le=MAX_LAYERS)
    micro_batches: int = spec(-1, "Micro-batches per step per data-parallel rank (= gradient "
                                  "accumulation); -1 = global_batch / (micro_batch_size * dp).", ge=-1,
                               le=1 << 24)
    layer_split: Optional[tuple[int, ...]] = spec(None, "Layers per (stage, chunk) in pipeline order, "
                                                        "pp * virtual_stages entries; null = even.",
                                                    ge=0, le=MAX_LAYERS)

    def __post_init__(self) -> None:
        if self.micro_batches == 0:
            raise StrategyError("strategy.pipeline.micro_batches: 0 micro-batches cannot train; "
                                "use -1 (derived from the batch) or a positive count")


@dataclass(frozen=True, kw_only=True)
class RecomputeSpec:
    policy: Literal["none", "selective", "full"] = spec(
        "none", "none: keep activations; selective: recompute attention core and MLP activation; "
                "full: keep only each layer's input.")
    num_layers: int = spec(-1, "Recompute only the first N layers of each stage; -1 = all.", ge=-1,
                           le=MAX_LAYERS)


@dataclass(frozen=True, kw_only=True)
class PrecisionSpec:
    param_dtype: DType = spec("bfloat16", "Parameters as the forward pass reads them.")
    compute_dtype: DType = spec("bfloat16", "Matmul / activation dtype.")
    grad_reduce_dtype: DType = spec("float32", "Dtype gradients are reduced in across data parallel.")
    master_dtype: DType = spec("float32", "Optimizer's copy of the weights.")
    loss_scale: Literal["none", "dynamic", "static"] = spec("none", "fp16 needs 'dynamic' or 'static'.")
    initial_loss_scale: float = spec(65536.0, "Starting (or static) loss scale.", ge=1.0, le=2.0 ** 32)


@dataclass(frozen=True, kw_only=True)
class OffloadSpec:
    optimizer: bool = spec(False, "Keep optimizer states (and master weights) in host memory (ZeRO-Offload).")
    params: bool = spec(False, "Keep sharded parameters in host memory between uses (ZeRO-3 only).")


CpAlgorithm = Literal["auto", "ring", "ulysses", "allgather"]
CP_ALGORITHMS: tuple[str, ...] = ("ring", "ulysses", "allgather")


@dataclass(frozen=True, kw_only=True)
class ContextParallelSpec:
    """How attention crosses the cp group; `strategy.cp` is the degree.

    ring       K/V blocks pass around the group (p2p) while each rank keeps its queries; partial
               results merge by log-sum-exp. The sequence is cut into 2*cp chunks, rank i holding
               i and 2*cp-1-i, so causal work is balanced. Megatron cp_comm_type p2p, torchtitan;
               MindFormers: FlashAttention with use_ring_attention (K/V kept sharded on the
               sequence over cp, the primitive's enable_ring_attention).
    ulysses    all-to-all from sequence-sharded to head-sharded around attention, and back
               (DeepSpeed-Ulysses, Megatron a2a). MindFormers ulysses_cp: FlashAttention sharded
               (dp, 1, cp*mp), heads over cp*tp, sequence whole.
    allgather  each rank all-gathers K/V (KV memory O(sequence)) and attends its own queries
               (Megatron all_gather). MindFormers colossalai_cp: FlashAttention q (dp, cp, mp),
               k/v (dp, 1, mp); its 2.x parallel_core maps colossalai_cp to cp_comm_type
               all_gather. MindFormers hybrid_cp (a2a+allgather) has no name here.
    """
    algorithm: CpAlgorithm = spec("auto", "ring | ulysses | allgather; 'auto' = the cost model picks "
                                          "(ms_llm.strategy.cost.cp_algorithm).")


@dataclass(frozen=True, kw_only=True)
class ParallelStrategy:
    dp: int = spec(-1, "Data-parallel degree (replicate x shard); -1 = world / (tp * pp * cp).", ge=-1,
                   le=MAX_WORLD_SIZE)
    tp: int = spec(1, "Tensor-parallel degree.", ge=1, le=MAX_WORLD_SIZE)
    pp: int = spec(1, "Pipeline-parallel degree.", ge=1, le=MAX_WORLD_SIZE)
    cp: int = spec(1, "Context-parallel degree (splits the sequence).", ge=1, le=MAX_WORLD_SIZE)
    ep: int = spec(1, "Expert-parallel degree: ranks the routed experts are split over, carved out of "
                      "dp * cp * tp / etp for expert layers.", ge=1, le=MAX_WORLD_SIZE)
    etp: int = spec(-1, "Expert-tensor-parallel degree: ranks each routed expert's width is split over "
                        "(column / row like the dense MLP); -1 = tp (Megatron's default), 1 = whole experts.",
                    ge=-1, le=MAX_WORLD_SIZE)
    sequence_parallel: bool = spec(False, "Shard norm/residual activations on the sequence over tp.")
    zero: ZeroSpec = field(default_factory=ZeroSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    recompute: RecomputeSpec = field(default_factory=RecomputeSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    offload: OffloadSpec = field(default_factory=OffloadSpec)
    context_parallel: ContextParallelSpec = spec(default_factory=ContextParallelSpec,
                                                 doc="Context-parallel algorithm (cp > 1).")

    def __post_init__(self) -> None:
        if self.dp == 0:
            raise StrategyError("strategy.dp: 0 ranks cannot hold a replica; use -1 (the leftover ranks) or >= 1")
        if self.etp == 0:
            raise StrategyError("strategy.etp: 0 ranks cannot hold an expert; use -1 (= tp), 1 (whole experts) "
                                "or a degree >= 2")
        _check_world(max(self.dp, 1) * self.model_parallel_size, "strategy: dp*tp*pp*cp")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def world_size(self) -> int:
        """World size this strategy names; only defined once dp is resolved."""
        if self.dp < 0:
            raise StrategyError("strategy.dp: -1 needs a world size to resolve; pass --world-size N")
        return self.dp * self.model_parallel_size

    def resolve(self, world_size: int | None = None) -> "ParallelStrategy":
        """Fill dp = -1 and zero.shard_size = -1 from the world size, etp = -1 from tp; check the product."""
        dp = self.dp
        if world_size is not None:
            _check_world(world_size, "the world size")
        if dp < 0:
            if world_size is None:
                raise StrategyError("strategy.dp: -1 needs a world size to resolve; pass --world-size N")
            if world_size % self.model_parallel_size:
                raise StrategyError(
                    f"strategy.dp: -1 cannot be resolved: world size {world_size} is not divisible by "
                    f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}; "
                    f"change the world size or the model-parallel degrees")
            dp = world_size // self.model_parallel_size
        elif world_size is not None and dp * self.model_parallel_size != world_size:
            raise StrategyError(
                f"strategy: dp*tp*pp*cp = {dp}*{self.tp}*{self.pp}*{self.cp} = {dp * self.model_parallel_size} "
                f"but the world size is {world_size}; set dp: -1 to use the leftover ranks, or change a degree")
        zero = self.zero
        if zero.shard_size == -1:
            zero = dataclasses.replace(zero, shard_size=dp)
        return dataclasses.replace(self, dp=dp, zero=zero, etp=self.expert_tp)

    @property
    def dp_shard(self) -> int:
        """Ranks a ZeRO shard group spans along dp (1 when ZeRO is off: plain replication)."""
        return self.zero.shard_size if self.zero.stage > 0 else 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def expert_tp(self) -> int:
        """etp with -1 read as tp: what a resolved strategy holds in etp."""
        return self.tp if self.etp == -1 else self.etp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks of a stage holding the same expert shard,
        dp * cp * tp / (ep * etp). Needs dp resolved (and validated: ep * etp divides)."""
        if self.dp < 0:
            raise StrategyError("strategy.dp: -1 needs a world size to resolve; pass --world-size N")
        return self.dp * self.cp * self.tp // (self.ep * self.expert_tp)


def _check_world(size: int, what: str) -> None:
    """Every rank gets a row in the plan's tables: refuse a world no cluster has before building them."""
    if not 1 <= size <= MAX_WORLD_SIZE:
        raise StrategyError(f"{what} = {size} devices; ms_llm plans 1 to {MAX_WORLD_SIZE} devices")
