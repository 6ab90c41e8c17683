"""The new world after a failure or when capacity returns.

    choose_world(capacity=6, tp*pp*cp=2)  ->  6, 4, 2 ranks, tp/pp/cp kept: the first plan that
                                              validates, fits in memory and the backend runs
                                          ->  else the strategy search at the largest world that
                                              holds any such plan: its fastest

Keeping tp/pp/cp and changing dp alone is tried first: the global batch does not change (the
plan gives each replica more micro-batches when dp shrinks, fewer when it grows) and the
sampler hands out the same global batch at every step whatever dp is, so the resumed run
follows the uninterrupted loss curve. When no such plan fits (fewer ranks than tp*pp*cp, or
less dp to shard ZeRO over than the memory needs), ms_llm.strategy.search picks the plan,
with the job's precision and offload, and `changes` names what it changed. The global batch
is never among them, so the data order holds there too. Checkpoints reshard on load.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from ms_llm.errors import StrategyError
from ms_llm.job import JobConfig
from ms_llm.strategy.cost import estimate
from ms_llm.strategy.devices import get_device
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import ModelPlan, plan
from ms_llm.strategy.search import describe, search

# The job's backend asked whether it runs a plan (ms_llm.backends.check, given by the CLI layer:
# the core imports no backend): raises StrategyError with the refusals.
BackendCheck = Callable[[ModelPlan], None]


def elastic_strategy(strategy: ParallelStrategy) -> ParallelStrategy:
    """The job's strategy with dp and the micro-batch count left to the world size."""
    return dataclasses.replace(strategy, dp=-1, pipeline=dataclasses.replace(strategy.pipeline, micro_batches=-1))


def replan(job: JobConfig, strategy: ParallelStrategy, world: int) -> ModelPlan:
    """The plan for `world` ranks: the job's own strategy first (its dp and micro-batches may
    fit), then with dp and micro-batches free. Raises the StrategyError of the latter."""
    try:
        return plan(job.model, strategy, job.train, world)
    except StrategyError:
        return plan(job.model, elastic_strategy(strategy), job.train, world)


def usable(job: JobConfig, p: ModelPlan, runs: BackendCheck) -> ModelPlan:
    """`p` when the backend runs it and it fits in the device's memory (the plan running now
    needs no estimate: it runs); else a StrategyError saying why."""
    runs(p)
    if p.strategy != job.strategy:
        device = get_device(job.device)
        need = estimate(p, device).memory.total
        if need > device.memory_bytes:
            raise StrategyError(f"needs {need / 1e9:.1f} GB per device, more than the "
                                f"{device.memory_bytes / 1e9:.0f} GB of a {job.device}")
    return p


def searched(job: JobConfig, strategy: ParallelStrategy, world: int, runs: BackendCheck) -> Optional[ModelPlan]:
    """The fastest plan for `world` ranks the strategy search finds that the backend runs, or None."""
    result = search(job.model, job.train, world, get_device(job.device), base=strategy)
    for candidate in result.ranked:
        try:
            return usable(job, plan(job.model, candidate.strategy, candidate.train, world), runs)
        except StrategyError:
            continue
    return None


def changes(job: JobConfig, q: ModelPlan) -> str:
    """What a new plan changes, as 'tp 2 -> 1, recompute none -> full' (empty: nothing)."""
    old, new = describe(job.strategy), describe(q.strategy)
    old["mbs"], new["mbs"] = job.train.micro_batch_size, q.train.micro_batch_size
    return ", ".join(f"{k} {old[k]} -> {new[k]}" for k in old if old[k] != new[k])


def choose_world(job: JobConfig, strategy: ParallelStrategy, capacity: int, min_ranks: int, runs: BackendCheck,
                 nodes: int = 1) -> tuple[Optional[ModelPlan], list[str]]:
    """The largest world <= capacity (and >= min_ranks, a multiple of the node count) with a
    usable plan, tp/pp/cp kept when any world allows it; None and the reasons when none does."""
    mp = strategy.model_parallel_size
    step = math.lcm(mp, nodes)
    reasons = []
    for world in range(capacity - capacity % step, max(min_ranks, 1) - 1, -step):
        if world <= 0:
            break
        try:
            return usable(job, replan(job, strategy, world), runs), reasons
        except StrategyError as exc:
            reasons.append(f"{world} rank(s) with tp/pp/cp kept: {exc}".splitlines()[0])
    for world in range(capacity - capacity % nodes, max(min_ranks, 1) - 1, -nodes):
        if world <= 0:
            break
        found = searched(job, strategy, world, runs)
        if found is not None:
            return found, reasons
        reasons.append(f"{world} rank(s): the strategy search found no plan that fits a {job.device} and the "
                       f"{job.backend} backend runs")
    if not reasons:
        reasons.append(f"{capacity} usable rank(s) hold no multiple of the node count {nodes} that is at least "
                       f"--min-ranks {min_ranks}")
    return None, reasons
