"""Automatic strategy search over the cost model (in the manner of Alpa / nnScaler, but exhaustive:
the space of LLaMA strategies on one cluster is small enough to price every point).

For a model, a global batch, a world size and a device, `search` enumerates data parallel x
ZeRO stage x tensor parallel (with and without sequence parallel) x pipeline parallel (1F1B, or
interleaved with v virtual stages) x micro-batch size (hence micro-batches) x context parallel x
recompute, and for MoE models expert parallel x expert tensor parallel (etp = tp, experts split
like the dense MLP, or 1, whole experts with ep folded over tp too), keeps what validate()
accepts and what fits in device memory, and ranks it by the cost model's step time. These keep it
fast and lose nothing the ranking would show (tests/strategy/test_search.py pins the 70B ranking):

- recompute is tried none -> selective -> full and the first that fits is kept: recomputing more
  only adds compute (and, for full, tensor-parallel traffic), so it is never faster;
- each point is priced from its CostShape (cost.shape_of), not a full per-tensor ModelPlan;
- memory comes first: a point (or, when cp picks its algorithm, an algorithm) that does not fit is
  not priced further, and the cp pick hands back its winner's estimate rather than pricing it again.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.errors import ConfigError, StrategyError
from ms_llm.strategy.cost import StepEstimate, estimate, memory, priced_cp_algorithm, replaced, shape_of
from ms_llm.strategy.devices import DeviceSpec
from ms_llm.strategy.ir import ContextParallelSpec, ParallelStrategy, PipelineSpec, RecomputeSpec
from ms_llm.strategy.validate import validate

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which values each degree may take. Degrees are also bounded by the world size and the model."""
    max_tp: int = 0                           # 0 = the device's node size (tp across nodes is never worth it)
    max_cp: int = 8
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    max_virtual_stages: int = 8
    recompute: tuple[str, ...] = RECOMPUTE_ORDER
    max_ep: int = 64                          # MoE: expert-parallel degrees tried (dividing dp*cp*tp/etp and the experts)


@dataclass(frozen=True)
class Candidate:
    strategy: ParallelStrategy          # resolved: explicit dp and micro-batches
    train: TrainConfig                  # the input's, with this candidate's micro_batch_size
    estimate: StepEstimate

    @property
    def key(self) -> tuple[float, float, float]:
        """Fastest first; among equally fast (communication fully hidden), the one that moves fewer
        bytes, then the one with more memory to spare: both leave slack the model does not see."""
        e = self.estimate
        return (e.step_s, sum(e.comm.bytes_by_axis.values()), e.memory.total)


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Candidate, ...]       # fits in memory, fastest first
    enumerated: int                     # strategies up to the recompute policy = invalid + too_big + ranked
    priced: int                         # cost evaluations, one per recompute policy tried
    invalid: int                        # rejected by validate()
    too_big: int                        # valid, but no recompute policy makes them fit
    seconds: float

    def rank_of(self, candidate: Candidate) -> int:
        """1-based position `candidate` would take in `ranked` (1 + how many are strictly faster)."""
        return 1 + sum(1 for c in self.ranked if c.estimate.step_s < candidate.estimate.step_s)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def price(model: ModelConfig, strategy: ParallelStrategy, train: TrainConfig, device: DeviceSpec,
          world_size: int | None = None) -> Candidate:
    """Validate and price one strategy the way the search prices its points."""
    s = validate(model, strategy, train, world_size)
    return Candidate(s, train, estimate(shape_of(model, s, train), device))


def _pipeline_options(model: ModelConfig, pp: int, space: SearchSpace) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    options = []
    for schedule in space.schedules:
        if schedule == "interleaved_1f1b":
            per_stage = model.num_layers // pp
            options += [(schedule, v) for v in _divisors(per_stage) if 2 <= v <= space.max_virtual_stages]
        elif schedule == "zbv":
            options.append((schedule, 2))
        else:
            options.append((schedule, 1))
    return options


def search(model: ModelConfig, train: TrainConfig, world_size: int, device: DeviceSpec,
           base: ParallelStrategy | None = None, space: SearchSpace | None = None) -> SearchResult:
    """Every valid strategy for `world_size` devices that fits, fastest first.

    `base` supplies what the search does not vary (precision, offload, expert parallel, ZeRO
    engine and bucket size); `train` fixes the global batch and sequence length."""
    if world_size < 1:
        raise ConfigError(f"--world-size: got {world_size}; need at least 1 device")
    base = base or ParallelStrategy()
    space = space or SearchSpace()
    max_tp = space.max_tp or device.devices_per_node
    start = time.perf_counter()
    found: list[Candidate] = []
    enumerated = priced = invalid = too_big = 0
    zeros = {stage: dataclasses.replace(base.zero, stage=stage, shard_size=-1) for stage in space.zero_stages}
    policies = [RecomputeSpec(policy=p) for p in space.recompute]
    for tp in (d for d in _divisors(world_size) if d <= max_tp):
        for cp in (d for d in _divisors(world_size // tp) if d <= space.max_cp):
            for pp in (d for d in _divisors(world_size // (tp * cp)) if d <= model.num_layers):
                dp = world_size // (tp * cp * pp)
                for (ep, etp), mbs in itertools.product(_expert_degrees(model, dp, cp, tp, base, space),
                                                        space.micro_batch_sizes):
                    if train.global_batch_size % (mbs * dp):
                        continue
                    t = dataclasses.replace(train, micro_batch_size=mbs)
                    for schedule, vpp in _pipeline_options(model, pp, space):
                        pipe = PipelineSpec(schedule=schedule, virtual_stages=vpp,
                                            micro_batches=train.global_batch_size // (mbs * dp))
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for zero in zeros.values():
                                enumerated += 1
                                s = ParallelStrategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp,
                                                     zero=zero, pipeline=pipe, recompute=policies[0],
                                                     precision=base.precision, offload=base.offload)
                                try:
                                    s = validate(model, s, t, world_size)
                                except StrategyError:
                                    invalid += 1
                                    continue
                                known = None             # policies[0]'s estimate, when picking cp's algorithm priced it
                                if cp > 1 and s.context_parallel.algorithm == "auto":
                                    # The cost model prices ring / ulysses / allgather on this device.
                                    algorithm, known = priced_cp_algorithm(shape_of(model, s, t), device)
                                    s = replaced(s, context_parallel=ContextParallelSpec(algorithm=algorithm))
                                for i, recompute in enumerate(policies):
                                    # No rule involves a whole-model recompute policy: validate once.
                                    priced += 1
                                    if i or known is None:
                                        s = replaced(s, recompute=recompute)
                                        est = _estimate_if_fits(model, s, t, device)
                                    else:
                                        est = known
                                    if est is not None and est.fits:
                                        found.append(Candidate(s, t, est))
                                        break
                                else:
                                    too_big += 1
    found.sort(key=lambda c: c.key)
    return SearchResult(tuple(found), enumerated, priced, invalid, too_big, time.perf_counter() - start)


def _estimate_if_fits(model: ModelConfig, s: ParallelStrategy, train: TrainConfig,
                      device: DeviceSpec) -> StepEstimate | None:
    """The estimate of a strategy that fits in memory; None, without pricing time, for one that does not."""
    shape = shape_of(model, s, train)
    mem = memory(shape)
    return estimate(shape, device, mem) if mem.total <= device.memory_bytes else None


def _expert_degrees(model: ModelConfig, dp: int, cp: int, tp: int, base: ParallelStrategy,
                    space: SearchSpace) -> list[tuple[int, int]]:
    """(ep, etp) pairs to try: the base's ep for a dense model (etp following tp); else etp = tp (each
    expert's width split like the dense MLP) or 1 (whole experts), where it divides the expert width,
    with every ep dividing dp*cp*tp/etp and the expert count (ep = 1 included: no all-to-all)."""
    if model.moe is None:
        return [(base.ep, -1)]
    out = []
    for etp in dict.fromkeys((tp, 1)):
        if model.expert_ffn_size % etp == 0:
            out += [(e, etp) for e in _divisors(dp * cp * tp // etp)
                    if e <= space.max_ep and model.moe.num_experts % e == 0]
    return out


def describe(s: ParallelStrategy) -> dict[str, object]:
    """The searched degrees of a strategy, as table columns."""
    return {"dp": s.dp, "zero": s.zero.stage, "tp": s.tp, "sp": "y" if s.sequence_parallel else "-",
            "pp": s.pp, "vpp": s.pipeline.virtual_stages, "mb": s.pipeline.micro_batches,
            "cp": s.cp if s.cp == 1 else f"{s.cp} {s.context_parallel.algorithm}",
            "ep": s.ep, "etp": s.etp, "recompute": s.recompute.policy}

