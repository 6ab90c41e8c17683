"""A liveness file per rank, rewritten after every step, for the elastic supervisor to read.

    <run>/heartbeat/rank_00003.json   {"rank": 3, "pid": 4242, "host": "n1", "step": 17, "phase": "train",
                                       "time": ...}

A rank whose file stops changing while its process lives is hung (a blocked collective, a
stopped process); `time` is the wall clock of the last write. A rank that fails writes
phase "failed" with the error's first line and its cause (failure_cause), so the supervisor
can tell a failure that will repeat from one that will not. Written to a temporary name and
renamed, so a reader never sees half a record.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from ms_llm.errors import CheckpointError, ConfigError, OutOfMemory, RunFolderError, StrategyError, TrainingDiverged

# Causes that repeat on every retry: the supervisor stops instead of restarting.
DETERMINISTIC = {"diverged": "the training diverged", "config": "the job's configuration is invalid",
                 "disk_full": "the disk is full", "read_only": "the run folder is read-only",
                 "out_of_memory": "a step needs more memory than a rank has"}


def failure_cause(exc: BaseException) -> str:
    """One word for what went wrong: a DETERMINISTIC key, or 'io' / 'error'."""
    if isinstance(exc, TrainingDiverged):
        return "diverged"
    if isinstance(exc, (ConfigError, StrategyError)):
        return "config"
    if isinstance(exc, OutOfMemory):
        return "out_of_memory"
    chain, seen = exc, 0
    while chain is not None and seen < 8:                  # the OSError under a CheckpointError
        if isinstance(chain, OSError):
            if chain.errno in (errno.ENOSPC, errno.EDQUOT):
                return "disk_full"
            if chain.errno == errno.EROFS:
                return "read_only"
            return "io"
        chain, seen = chain.__cause__ or chain.__context__, seen + 1
    return "io" if isinstance(exc, (CheckpointError, RunFolderError)) else "error"


class Heartbeat:
    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank:05d}.json"
        self.rank = rank
        self.host = socket.gethostname()

    def beat(self, step: int, phase: str = "train", **extra) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "step": step, "phase": phase,
                  "time": time.time(), **extra}
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError as exc:           # a full disk: the worker stops with this one line (the cause chained)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise RunFolderError(f"run folder {self.path.parent.parent}: cannot write rank {self.rank}'s "
                                 f"heartbeat ({exc.strerror or exc})") from exc

    def fail(self, step: int, exc: BaseException) -> None:
        """Best effort: on a full disk even this small file may not be written."""
        with contextlib.suppress(RunFolderError):          # the worker's own exit status still reports it
            self.beat(step, phase="failed", error=f"{type(exc).__name__}: {first_line(exc)}",
                      cause=failure_cause(exc))


def first_line(exc: BaseException) -> str:
    """The error's first line that says something. MindSpore's open with a rule of dashes and a
    heading ('- Kernel error:') before the line that names what failed."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line.strip("-= ") and not (line.startswith("- ") and line.endswith(":")):
            return line
    return type(exc).__name__


def read_heartbeats(folder: Path) -> dict[int, dict]:
    """rank -> its last record (files being replaced are skipped, not an error)."""
    beats = {}
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            beats[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def failed_since(folder: Path, since: float) -> dict[int, dict]:
    """rank -> its failure record, for the ranks that recorded one at or after `since` (an earlier
    launch's records are not this one's)."""
    return {rank: b for rank, b in read_heartbeats(folder).items()
            if b.get("phase") == "failed" and b.get("time", 0) >= since}


def failure_lines(folder: Path, since: float, exits: Mapping[int, int]) -> list[str]:
    """One line per rank that failed, in rank order: how it ended (`exits`: rank -> its exit
    status as the backend's launcher reported it, negative for a signal) and the error it
    recorded. What the console gets in place of the launcher's own report."""
    failed = failed_since(folder, since)
    lines = []
    for rank in sorted(set(failed) | set(exits)):
        code = exits.get(rank)
        if code is None:
            how = "failed"
        elif code < 0:
            how = f"was killed by {_signal_name(-code)}"
        else:
            how = f"exited with {code}"
        if rank in failed:
            record = failed[rank]
            lines.append(f"rank {rank} {how} after step {record.get('step', '?')}: {record.get('error', '')}")
        else:
            lines.append(f"rank {rank} {how}" + ("" if code is None or code < 0 else " (no error recorded)"))
    return lines


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
