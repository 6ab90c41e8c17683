"""Which collective runs for each bucket, over which group, at which point of the step.

    stage 0  grads: all-reduce(dp) once the last micro-batch's backward fills the bucket
    stage 1  grads: reduce-scatter(shard) [+ all-reduce(replicate)] on the last micro-batch
             (earlier micro-batches accumulate into the full local gradient);
             params: all-gather(shard) after the optimizer step
    stage 2  grads: reduce-scatter(shard) [+ all-reduce(replicate)] in every micro-batch's
             backward, accumulated into the gradient shard; params: all-gather after the step
    stage 3  params: all-gather(shard) before the unit's forward and again before its
             backward (the next unit prefetched), freed after each; grads as stage 2
Replicated buckets (parameters the shard group cannot split) are all-reduced over dp
on the last micro-batch at every stage and never gathered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Op = Literal["reduce_scatter", "all_reduce", "all_gather"]
Group = Literal["shard", "replicate", "dp"]
Phase = Literal["backward", "backward_sync", "after_step", "before_forward", "before_backward"]


@dataclass(frozen=True)
class Collective:
    op: Op
    group: Group
    phase: Phase


def grad_collectives(stage: int, sharded: bool, replicate_size: int) -> tuple[Collective, ...]:
    """Gradient reduction of one bucket, in issue order."""
    if not sharded:
        return (Collective("all_reduce", "dp", "backward_sync"),)
    phase: Phase = "backward" if stage >= 2 else "backward_sync"
    ops = [Collective("reduce_scatter", "shard", phase)]
    if replicate_size > 1:
        ops.append(Collective("all_reduce", "replicate", phase))
    return tuple(ops)


def param_collectives(stage: int, sharded: bool) -> tuple[Collective, ...]:
    """Parameter gathers of one bucket."""
    if not sharded:
        return ()
    if stage == 3:
        return (Collective("all_gather", "shard", "before_forward"),
                Collective("all_gather", "shard", "before_backward"))
    return (Collective("all_gather", "shard", "after_step"),)
