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
import socket
import time
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
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def fail(self, step: int, exc: BaseException) -> None:
        """Best effort: on a full disk even this small file may not be written."""
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        with contextlib.suppress(OSError):                 # the worker's own exit status still reports it
            self.beat(step, phase="failed", error=f"{type(exc).__name__}: {text}", cause=failure_cause(exc))


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
