"""How often to checkpoint: minimise the expected time lost per hour (Young / Daly).

With a checkpoint every tau seconds, a training stall t_stall per save, a save durable
t_total after it starts, a restart costing t_rtvl and a mean time between failures M:

    W(tau) = 3600 * ( t_stall / tau  +  (tau/2 + t_total + t_rtvl) / M )   seconds per hour

The first term is the stall paid on every save; the second is what each failure costs:
on average half an interval of lost steps, plus the persist lag (the newest save may not
be durable yet), plus the restart. dW/dtau = 0 gives Young's tau* = sqrt(2 * t_stall * M).
A save must be finished before the next begins and cannot be more frequent than a step,
so tau >= max(t_total, T_iter) (the seed's 1/f >= max(t_ckpt, T_iter)); tau is then rounded
to whole steps, keeping the cheaper neighbour.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ms_llm.errors import ConfigError


@dataclass(frozen=True)
class IntervalInputs:
    stall_s: float                  # training blocked per save
    total_s: float                  # save start to durable
    iter_s: float                   # one training step
    restore_s: float                # restart + load; the caller's estimate when not measured yet
    mtbf_hours: float

    def __post_init__(self) -> None:
        for name in ("stall_s", "total_s", "restore_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint interval: {name} = {getattr(self, name)} must be >= 0")
        if self.iter_s <= 0:
            raise ConfigError(f"checkpoint interval: iter_s = {self.iter_s} must be > 0 (seconds per step)")
        if self.mtbf_hours <= 0:
            raise ConfigError(f"checkpoint interval: mtbf_hours = {self.mtbf_hours} must be > 0; it is "
                              "train.checkpoint.mtbf_hours")
        if self.total_s < self.stall_s:
            raise ConfigError(f"checkpoint interval: total_s = {self.total_s} is shorter than the stall "
                              f"{self.stall_s}; total counts from the start of the save")


@dataclass(frozen=True)
class IntervalDecision:
    steps: int
    seconds: float
    wasted_s_per_hour: float
    reasoning: tuple[str, ...] = field(default=())

    def report(self) -> str:
        return "\n".join(self.reasoning)


def wasted_per_hour(x: IntervalInputs, tau: float) -> float:
    m = x.mtbf_hours * 3600.0
    return 3600.0 * (x.stall_s / tau + (tau / 2 + x.total_s + x.restore_s) / m)


def choose_interval(x: IntervalInputs) -> IntervalDecision:
    m = x.mtbf_hours * 3600.0
    young = math.sqrt(2.0 * x.stall_s * m)
    floor = max(x.total_s, x.iter_s)
    tau = max(young, floor)
    lo = max(1, math.floor(tau / x.iter_s))
    options = [n for n in (lo, lo + 1) if n * x.iter_s >= floor] or [lo + 1]
    steps = min(options, key=lambda n: wasted_per_hour(x, n * x.iter_s))
    seconds = steps * x.iter_s
    w = wasted_per_hour(x, seconds)
    lines = [
        "checkpoint interval: minimise W(tau) = 3600*(t_stall/tau + (tau/2 + t_total + t_rtvl)/MTBF) s/hour",
        f"  measured: t_stall {x.stall_s:.3g} s, t_total {x.total_s:.3g} s, T_iter {x.iter_s:.3g} s, "
        f"t_rtvl {x.restore_s:.3g} s, MTBF {x.mtbf_hours:.3g} h",
        f"  unconstrained optimum (Young): tau* = sqrt(2*t_stall*MTBF) = {young:.1f} s",
        f"  constraint tau >= max(t_total, T_iter) = {floor:.3g} s -> tau = {tau:.1f} s",
        f"  -> every {steps} steps ({seconds:.1f} s): W = {w:.1f} s/hour ({100 * w / 3600:.2f}% of the run)",
    ]
    for other in sorted({max(1, steps // 4), max(1, steps // 2), steps * 2, steps * 4} - {steps}):
        if other * x.iter_s >= floor:
            wo = wasted_per_hour(x, other * x.iter_s)
            lines.append(f"     every {other} steps instead: W = {wo:.1f} s/hour")
    return IntervalDecision(steps, seconds, w, tuple(lines))

