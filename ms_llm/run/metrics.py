"""Progress lines, metrics.jsonl (and its TensorBoard events) and the tokens/s and MFU of a step,
identical for both backends."""
from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from ms_llm.job import JobConfig
from ms_llm.run.tensorboard import TensorBoardLog
from ms_llm.strategy.devices import get_device


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    mfu: float
    memory_gb: float
    grad_norm: float = float("nan")
    step_time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def line(self, total_steps: int) -> str:
        text = (f"step {self.step:>5}/{total_steps} | loss {self.loss:.4f} | lr {self.lr:.2e} | "
                f"{self.tokens_per_s:,.0f} tok/s | MFU {100 * self.mfu:.2f}% | mem {self.memory_gb:.2f} GB")
        if self.grad_norm == self.grad_norm:
            text += f" | gnorm {self.grad_norm:.3f}"
        if "val_loss" in self.extra:
            text += f" | val loss {self.extra['val_loss']:.4f}"
        if "mtp_loss" in self.extra:
            text += f" | mtp loss {self.extra['mtp_loss']:.4f}"
        if "max_expert_load" in self.extra:
            text += f" | max load {self.extra['max_expert_load']:.2f}x"
        return text


def max_expert_load(loads: np.ndarray) -> float:
    """The busiest expert's share over the mean share, at the least balanced MoE layer (1.0 when
    every expert gets as many token copies): what aux-loss-free balancing drives down.
    loads (layers, experts); rows of layers this rank does not hold are all zero and left out."""
    held = loads[loads.sum(axis=1) > 0]
    return float((held.max(axis=1) / held.mean(axis=1)).max()) if len(held) else float("nan")


@dataclass(frozen=True)
class StepRate:
    """What one optimizer step computes, for tokens/s and MFU: one formula for every backend."""
    tokens: int                    # global batch x sequence length
    flops: float                   # model FLOPs of those tokens, forward and backward
    peak_flops: float              # of every device of the job together

    @classmethod
    def of(cls, job: JobConfig, world: int) -> "StepRate":
        t = job.train
        tokens = t.global_batch_size * t.seq_len
        return cls(tokens, job.model.flops_per_token(t.seq_len) * tokens, get_device(job.device).peak_flops * world)

    def metrics(self, step: int, loss: float, lr: float, elapsed: float, memory_gb: float,
                grad_norm: float = float("nan")) -> StepMetrics:
        return StepMetrics(step=step, loss=loss, lr=lr, tokens_per_s=self.tokens / elapsed,
                           mfu=self.flops / elapsed / self.peak_flops, memory_gb=memory_gb, grad_norm=grad_norm,
                           step_time_s=elapsed)


def peak_rss_gb() -> float:
    """This process's peak resident memory (ru_maxrss counts KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Rank 0 writes metrics.jsonl and the same numbers as TensorBoard events in the run folder's
    tensorboard/; other ranks hold a logger that does nothing, so callers need no branches."""

    def __init__(self, path: Path | None, total_steps: int, every: int, stream: TextIO = sys.stdout):
        self.path, self.total, self.every, self.stream = path, total_steps, every, stream
        self._file = None
        self._tensorboard = None
        if path is not None:
            _drop_torn_tail(Path(path))
            self._file = open(path, "a")
            self._tensorboard = TensorBoardLog(Path(path).with_name("tensorboard"), stream)

    def log(self, m: StepMetrics, force: bool = False) -> None:
        if self._file is None:
            return
        self._write({k: v for k, v in asdict(m).items() if k != "extra"} | m.extra)
        if force or m.step % self.every == 0 or m.step == self.total or "val_loss" in m.extra:
            print(m.line(self.total), file=self.stream, flush=True)

    def event(self, **fields) -> None:
        if self._file is not None:
            self._write(fields)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._tensorboard.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._tensorboard.close()


def _drop_torn_tail(path: Path) -> None:
    """A run killed mid-write can leave a partial last record; a restarted run appends after
    the last whole one."""
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: Path) -> list[dict]:
    """Whole records only: a last line without its newline is still being written."""
    lines = Path(path).read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def run_summary(path: Path, since: int) -> str:
    """The `done:` line of one launch, from the step records written after byte `since` of
    metrics.jsonl (the same for both backends: the launcher prints it, not a worker)."""
    if not Path(path).is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").split("\n")[:-1]
    steps = [r for r in (json.loads(line) for line in lines if line.strip()) if "loss" in r and "step" in r]
    if not steps:
        return ""
    first, last = steps[0], steps[-1]
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    return (f"done: steps {first['step']}-{last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}{val}, "
            f"{sum(r.get('step_time_s', 0.0) for r in steps):.1f} s of steps")
