"""Progress lines, metrics.jsonl (and its TensorBoard events) and the tokens/s and MFU of a step,
identical for both backends."""
from __future__ import annotations

import errno
import json
import os
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
        self._file: int | None = None           # an O_APPEND descriptor: each record is one write
        self._tensorboard = None
        if path is not None:
            _drop_torn_tail(Path(path))
            self._file = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
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
        append_line(self._file, record)
        self._tensorboard.write(record)

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
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


def append_line(fd: int, record: dict) -> None:
    """`record` as one line, in one write on an O_APPEND descriptor: rank 0 and the elastic
    supervisor append to the same file and neither splits the other's line. After a torn last line
    (a writer killed mid-write, a full disk) the record starts on a line of its own; a short write
    (the disk filled up in between) is an ENOSPC error, its bytes left for the readers to skip."""
    line = (json.dumps(record) + "\n").encode()
    end = os.fstat(fd).st_size
    if end and os.pread(fd, 1, end - 1) != b"\n":
        line = b"\n" + line
    if os.write(fd, line) != len(line):
        raise OSError(errno.ENOSPC, f"short write of a metrics record ({len(line)} bytes)")


def append_record(path: Path, record: dict) -> None:
    """One whole line appended to metrics.jsonl by a process that does not keep it open."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_line(fd, record)
    finally:
        os.close(fd)


def read_records(path: Path, since: int = 0) -> tuple[list[dict], int]:
    """The whole records after byte `since`, and the offset after the last whole line, where the
    next read starts. A last line without its newline is still being written, or torn, and is left
    out; a line that is not a JSON object (a torn record a later append ended, the rest of a record
    an offset fell inside) is skipped."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except FileNotFoundError:
        return [], since
    whole = data[:data.rfind(b"\n") + 1]
    records = []
    for line in whole.split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:                     # bad bytes or JSON, an empty line
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, since + len(whole)


def whole_end(path: Path) -> int:
    """The offset after the last whole line of metrics.jsonl (0 when there is none): a reader that
    starts here still starts at a record once a restarted rank 0 drops a torn tail."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                chunk = f.read(end - start)
                if (i := chunk.rfind(b"\n")) >= 0:
                    return start + i + 1
                end = start
    except FileNotFoundError:
        return 0                                 # no metrics yet: a reader starts at the top
    return 0


def read_metrics(path: Path) -> list[dict]:
    """Every whole record (read_records)."""
    return read_records(path)[0]


def run_summary(path: Path, since: int) -> str:
    """The `done:` line of one launch, from the step records written after byte `since` of
    metrics.jsonl (the same for both backends: the launcher prints it, not a worker)."""
    steps = [r for r in read_records(path, since)[0] if "loss" in r and "step" in r]
    if not steps:
        return ""
    first, last = steps[0], steps[-1]
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    return (f"done: steps {first['step']}-{last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}{val}, "
            f"{sum(r.get('step_time_s', 0.0) for r in steps):.1f} s of steps")
