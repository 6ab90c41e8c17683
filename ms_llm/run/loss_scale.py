"""Loss scaling for float16 training, one policy for both backends.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The step multiplies the loss
by `scale` before backward (so every gradient is `scale` times too large), divides the
gradients back before clipping and the update, and skips the update of a step whose
gradients are not finite. The policy decides the next scale:

  dynamic  torch GradScaler / Megatron semantics: halve on a non-finite step, double after
           GROWTH_INTERVAL consecutive finite ones. 1000 is Megatron's loss_scale_window and
           DeepSpeed's default (GradScaler's growth_interval is 2000). A step that overflows
           when the scale cannot halve without falling below MIN_SCALE is divergence, not
           an fp16 range problem: TrainingDiverged names the step (DeepSpeed stops there too).
  static   the initial scale throughout; non-finite steps are still skipped.

    scaler = LossScaler.from_precision(strategy.precision)     # None when loss_scale: none
    (loss * scaler.scale).backward()
    norm = <global gradient norm> / scaler.scale               # the same on every rank
    if math.isfinite(norm): <gradients / scaler.scale, clip, optimizer step>
    scaler.update(math.isfinite(norm), step)                   # then the next step's scale

The state (scale, good-step count, skipped steps) goes into the checkpoint's training-state
record with `state()` and back with `load_state()`, so a resumed run continues the scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from ms_llm.errors import TrainingDiverged

if TYPE_CHECKING:
    from ms_llm.strategy.ir import PrecisionSpec

GROWTH_INTERVAL = 1000      # consecutive finite steps before the dynamic scale doubles
MIN_SCALE = 1.0             # an overflow at this scale is divergence


@dataclass
class LossScaler:
    mode: Literal["dynamic", "static"]
    scale: float                            # the loss multiplier of the next step
    growth_interval: int = GROWTH_INTERVAL
    min_scale: float = MIN_SCALE
    good_steps: int = 0                     # finite steps since the scale last changed
    skipped: int = 0                        # steps skipped over the whole run (optimizer steps = steps - skipped)

    @classmethod
    def from_precision(cls, precision: "PrecisionSpec") -> Optional["LossScaler"]:
        """The scaler strategy.precision asks for; None for loss_scale: none."""
        if precision.loss_scale == "none":
            return None
        return cls(precision.loss_scale, float(precision.initial_loss_scale))

    def update(self, finite: bool, step: int) -> None:
        """Record whether step `step`'s gradients were finite (judged from the global norm, so
        every rank agrees) and set the scale of the next step."""
        if finite:
            self.good_steps += 1
            if self.mode == "dynamic" and self.good_steps == self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0
            return
        self.skipped += 1
        self.good_steps = 0
        if self.mode == "dynamic":
            if self.scale / 2.0 < self.min_scale:
                raise TrainingDiverged(
                    f"training diverged at step {step}: gradients are not finite even at loss scale "
                    f"{self.scale:g}, the minimum ({self.min_scale:g}); lower train.optimizer.lr or raise warmup, "
                    "or train in bfloat16 (strategy.precision)")
            self.scale /= 2.0

    def state(self) -> dict:
        """JSON-ready record for the checkpoint's training state."""
        return {"mode": self.mode, "scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state(self, state: Optional[dict]) -> None:
        """Continue from a checkpoint's record (None: saved without loss scaling, keep the start).
        A static scale stays the configured one, so a resumed run can change it."""
        if not state:
            return
        self.skipped = int(state["skipped"])
        if self.mode == "dynamic" and state["mode"] == "dynamic":
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
