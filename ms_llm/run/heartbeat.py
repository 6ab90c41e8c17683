"""A liveness file per rank, rewritten after every step, for the elastic supervisor to read.

    <run>/heartbeat/rank_00003.json   {"rank": 3, "pid": 4242, "step": 17, "phase": "train", "time": ...}

A rank whose file stops changing while its process lives is hung (a blocked collective, a
stopped process); `time` is the wall clock of the last write. Written to a temporary name and
renamed, so a reader never sees half a record.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Heartbeat:
    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank_{rank:05d}.json"
        self.rank = rank

    def beat(self, step: int, phase: str = "train") -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "step": step, "phase": phase, "time": time.time()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)


def read_heartbeats(folder: Path) -> dict[int, dict]:
    """rank -> its last record (files being replaced are skipped, not an error)."""
    beats = {}
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        beats[int(record["rank"])] = record
    return beats
