"""The training state a checkpoint's head holds, checked against what a resume does with it.

    "state": {"step": 6, "optimizer_step": 5, "lr": 0.0003,
              "sampler": {"seed": 7, "epoch": 0, "position": 48, "index": ""},
              "loss_scale": {"mode": "dynamic", "scale": 32768.0, "good_steps": 3, "skipped": 1}}  (or null)
    "rank_states": {"0": {"torch_rng": <5056 bytes>}, ...}

A resume sets the optimizer's step count from optimizer_step (Adam's bias correction), the loss
scaler from loss_scale, the data order from sampler and each rank's generator from its own
state, after the point where it can still fall back to the previous checkpoint. The head is
untrusted input: a negative optimizer_step made the bias correction complex and crashed the first
step, 1e30 overflowed the step counter, a 3-byte generator state crashed torch.set_rng_state. So
every field the trainer writes (TrainerCheckpoints.save) is checked here while the checkpoint is
loaded, and a bad one is a CheckpointError naming it: the resume then tries the previous
checkpoint. Other fields (a hand-saved scheduler state) pass, and so does a state without the
trainer's fields (an imported checkpoint's {}).
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Mapping, Optional

from ms_llm.checkpoint.storage.untrusted import MAX_COUNT, integer
from ms_llm.config.schema import shown
from ms_llm.errors import CheckpointError
from ms_llm.run.loss_scale import GROWTH_INTERVAL

MAX_LOSS_SCALE = 2.0 ** 64      # the dynamic scale starts at most at 2**32 and doubles once per 1000 finite steps


def _mt19937_problem(state: bytes) -> Optional[str]:
    """What torch.set_rng_state would refuse in a CPU generator state of the right size:
    mt19937::is_valid (seeded, 1 <= left <= 624, next <= 624) over its fields
    (uint64 seed, int32 left, int32 seeded, uint64 next, the 624 words...)."""
    _, left, seeded, following = struct.unpack_from("<QiiQ", state, 0)
    if seeded and 1 <= left <= 624 and following <= 624:
        return None
    return f"is not a valid mt19937 state (left {left}, seeded {seeded}, next {following}); torch refuses it"


# What each backend saves as a rank's own state, and the size and check its set_rank_state needs:
# torch the CPU generator (torch.get_rng_state(): uint8, torch's CPUGeneratorImplState). MindSpore
# saves none (its model draws no random numbers while training: ms_llm/mindspore/state.py).
RANK_STATES: dict[str, tuple[str, int, Callable[[bytes], Optional[str]]]] = {
    "torch_rng": ("torch.get_rng_state() of the CPU generator", 5056, _mt19937_problem),
}


def check_saved_state(state: Mapping[str, Any], rank_states: Mapping[int, Mapping[str, Any]], step: int,
                      where: str) -> None:
    """Refuse (CheckpointError naming `where` and the field) a training state or a rank's state
    that a resume at `step` could not use as it is."""
    if "step" in state and (type(state["step"]) is not int or state["step"] != step):
        raise CheckpointError(f"{where}: 'state.step' is {shown(state['step'])} but the checkpoint is of step {step}")
    optimizer_step = None
    if "optimizer_step" in state:   # steps minus those a loss scale skipped: it never exceeds them
        optimizer_step = integer(state["optimizer_step"], where, "state.optimizer_step", 0, step)
    if "lr" in state and (isinstance(state["lr"], bool) or not isinstance(state["lr"], (int, float))
                          or not math.isfinite(state["lr"])):
        raise CheckpointError(f"{where}: 'state.lr' is {shown(state['lr'])}; expected a finite number")
    if state.get("sampler") is not None:
        _check_sampler(state["sampler"], where)
    if state.get("loss_scale") is not None:
        skipped = _check_loss_scale(state["loss_scale"], step, where)
        if optimizer_step is not None and optimizer_step + skipped > step:
            raise CheckpointError(f"{where}: state.optimizer_step {optimizer_step} + loss_scale.skipped {skipped} > "
                                  f"step {step}; a step either updated or was skipped (an imported run's skipped "
                                  "iterations, which no loss scale counts, make the sum smaller)")
    for rank, own in sorted(rank_states.items()):
        for key, (what, nbytes, problem) in RANK_STATES.items():
            if key not in own:
                continue
            value, field = own[key], f"rank_states[{rank}].{key}"
            if not isinstance(value, bytes):
                raise CheckpointError(f"{where}: '{field}' is {shown(value)}; expected {nbytes} bytes ({what})")
            if len(value) != nbytes:
                raise CheckpointError(f"{where}: '{field}' is {len(value)} bytes; {what} is {nbytes}")
            wrong = problem(value)
            if wrong:
                raise CheckpointError(f"{where}: '{field}' {wrong}")


def _check_sampler(sampler: object, where: str) -> None:
    """The data position (ms_llm.data.sampler.SamplerState); the resume also holds it to the step."""
    if not isinstance(sampler, dict):
        raise CheckpointError(f"{where}: 'state.sampler' is {shown(sampler)}; expected a JSON object")
    for name in ("seed", "epoch", "position"):
        integer(sampler.get(name), where, f"state.sampler.{name}", 0, MAX_COUNT)
    if not isinstance(sampler.get("index", ""), str):
        raise CheckpointError(f"{where}: 'state.sampler.index' is {shown(sampler['index'])}; expected a string")


def _check_loss_scale(record: object, step: int, where: str) -> int:
    """A LossScaler.state() record (ms_llm/run/loss_scale.py); returns its skipped steps."""
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: 'state.loss_scale' is {shown(record)}; expected null or a JSON object")
    if record.get("mode") not in ("dynamic", "static"):
        raise CheckpointError(f"{where}: 'state.loss_scale.mode' is {shown(record.get('mode'))}; expected 'dynamic' "
                              "or 'static'")
    scale = record.get("scale")
    if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
            or not 1.0 <= scale <= MAX_LOSS_SCALE):
        raise CheckpointError(f"{where}: 'state.loss_scale.scale' is {shown(scale)}; expected a number in [1, 2**64]")
    integer(record.get("good_steps"), where, "state.loss_scale.good_steps", 0, min(step, GROWTH_INTERVAL - 1))
    return integer(record.get("skipped"), where, "state.loss_scale.skipped", 0, step)
