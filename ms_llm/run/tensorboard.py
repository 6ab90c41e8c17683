"""metrics.jsonl's numbers as TensorBoard event files in <run>/tensorboard/, written by rank 0
through tensorboardX, an optional extra (`pip install 'ms_llm[report]'`). Without it the run writes
no events and says so once; the core never needs it."""
from __future__ import annotations

import importlib
import math
import sys
import time
from pathlib import Path
from typing import TextIO

HINT = "TensorBoard events: not written (tensorboardX is not installed; pip install 'ms_llm[report]')"
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu",
             "memory_gb": "train/memory_gb", "grad_norm": "train/grad_norm", "step_time_s": "train/step_time_s",
             "val_loss": "val/loss"}
EVENT_STEP_KEYS = ("step", "resumed_step", "checkpoint_step")   # which step an event record belongs to


def scalars(record: dict, last_step: int) -> tuple[int, dict[str, float]]:
    """(step, {tag: value}) of one metrics.jsonl record. A step record's numbers go under train/
    (val/loss); an event's (resume, checkpoint, recovery) under events/, at the step it names,
    else at the last logged step. Non-finite values (a grad norm nobody measured) are left out."""
    is_step = "step" in record and "loss" in record
    step = next((int(record[k]) for k in EVENT_STEP_KEYS if _number(record.get(k))), last_step)
    tags = {}
    for key, value in record.items():
        if _number(value) and math.isfinite(value) and not (is_step and key == "step"):
            tags[STEP_TAGS.get(key, f"train/{key}") if is_step else f"events/{key}"] = float(value)
    return step, tags


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _summary_writer():
    """tensorboardX's SummaryWriter, or None when it is not installed. tensorboardX imports torch
    when it can (to accept tensors); a MindSpore worker must not load torch for that, so torch is
    hidden while tensorboardX is imported unless this process already holds it."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None                    # `import torch` raises ImportError, which tensorboardX allows
    try:
        return importlib.import_module("tensorboardX").SummaryWriter
    except ImportError:
        return None
    finally:
        if hide:
            del sys.modules["torch"]


class TensorBoardLog:
    """Opened at the first record of a launch. A restarted launch purges the events of the steps
    it replays (TensorBoard's purge_step), so the curves show each step once."""

    def __init__(self, folder: Path, stream: TextIO):
        self.folder, self.stream = folder, stream
        self._writer = None
        self._missing = False
        self._last_step = 0

    def write(self, record: dict) -> None:
        if self._missing:
            return
        step, tags = scalars(record, self._last_step)
        if self._writer is None and not self._open(record, step):
            return
        for tag, value in tags.items():
            self._writer.add_scalar(tag, value, step)
        if "loss" in record:
            self._last_step = step

    def _open(self, first: dict, step: int) -> bool:
        writer = _summary_writer()
        if writer is None:
            self._missing = True
            print(HINT, file=self.stream, flush=True)
            return False
        purge = int(first["resumed_step"]) + 1 if "resumed_step" in first else step if "loss" in first else None
        # tensorboardX names files by the second; a launch restarted within one must neither overwrite
        # the last one's file nor sort before it (TensorBoard reads the files in name order).
        self._writer = writer(str(self.folder), purge_step=purge, flush_secs=10, filename_suffix=f".{time.time_ns()}")
        return True

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

