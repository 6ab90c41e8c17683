"""The new world after a failure or when capacity returns: keep tp/pp/cp, change dp.

    world(capacity=6, tp*pp*cp=2, min_ranks=2)  ->  tries 6, 4, 2: the first plan that validates

dp is the only degree that changes, and the global batch does not: the plan gives each
replica more micro-batches (gradient accumulation) when dp shrinks, fewer when it grows, and
the sampler hands out the same global batch at every step whatever dp is, so the resumed run
follows the uninterrupted loss curve. Checkpoints reshard on load (ms_llm.checkpoint).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ms_llm.config.job import JobConfig
from ms_llm.errors import StrategyError
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import ModelPlan, plan


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


def choose_world(job: JobConfig, strategy: ParallelStrategy, capacity: int, min_ranks: int,
                 nodes: int = 1) -> tuple[Optional[ModelPlan], list[str]]:
    """The largest world <= capacity (and >= min_ranks, a multiple of the model-parallel size and
    of the node count) whose plan validates; None and the reasons when there is none."""
    mp = strategy.model_parallel_size
    step = math.lcm(mp, nodes)
    reasons = []
    for world in range(capacity - capacity % step, max(min_ranks, 1) - 1, -step):
        if world <= 0:
            break
        try:
            return replan(job, strategy, world), reasons
        except StrategyError as exc:
            reasons.append(f"{world} ranks: {exc}".splitlines()[0])
    if not reasons:
        reasons.append(f"{capacity} usable rank(s) hold no multiple of tp*pp*cp = {mp} (x {nodes} node(s)) "
                       f"that is at least --min-ranks {min_ranks}")
    return None, reasons

