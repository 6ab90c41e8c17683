"""Learning rate at a step: linear warmup, then cosine / linear decay to min_lr_ratio * lr."""
from __future__ import annotations

import math

from ms_llm.config.train import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The rate of 0-based update `step` (update k = step k-1), the one schedule both backends use."""
    peak, sched = train.optimizer.lr, train.schedule
    if step < sched.warmup_steps:
        return peak * (step + (0 if sched.warmup_from_zero else 1)) / sched.warmup_steps
    floor = peak * sched.min_lr_ratio
    span = max(1, train.steps - sched.warmup_steps)
    progress = min(1.0, (step - sched.warmup_steps) / span)
    if sched.decay == "constant":
        return peak
    if sched.decay == "linear":
        return floor + (peak - floor) * (1 - progress)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
