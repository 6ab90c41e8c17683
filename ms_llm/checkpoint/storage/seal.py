"""The memory tier keeper's seal: "I verified these files and nobody has written them since".

After a checkpoint is committed to the memory tier, the keeper (ms_llm/run/keeper.py) checks every
checksum of it once and writes <step folder>/sealed.json holding, per shard file, the
inode, size, mtime and ctime it had while being checked. A restore that opens a file whose
fstat still shows those four values reads it without a second checksum pass: any write,
truncation or replacement since changes the ctime (which no user can set back), and the
file is checked block by block as on disk. Seals count only inside a memory tier (a folder
whose parent holds the keeper's lock file); disk checkpoints are always checked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ms_llm.checkpoint.storage.untrusted import integers, parse_json, read_regular
from ms_llm.errors import CheckpointError

SEAL = "sealed.json"
KEEPER_LOCK = "keeper.lock"


def fingerprint(st: os.stat_result) -> tuple[int, ...]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class Seal:
    files: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: Path) -> "Seal":
        """The seal of a memory-tier step folder; an empty one elsewhere or when it is absent or
        malformed (then every block is checked: a bad seal only costs time)."""
        if not (folder.parent / KEEPER_LOCK).is_file():
            return cls()
        try:
            data = parse_json(read_regular(folder / SEAL), str(folder / SEAL))
            return cls({name: integers(v, str(folder / SEAL), name, hi=1 << 63, length=4)
                        for name, v in data["files"].items()})
        except (OSError, ValueError, TypeError, KeyError, AttributeError, CheckpointError):
            return cls()

    def matches(self, name: str, st: os.stat_result) -> bool:
        return self.files.get(name) == fingerprint(st)


def write_seal(folder: Path, files: dict[str, tuple[int, ...]]) -> None:
    """Publish the seal atomically (a reader sees all of it or none)."""
    tmp = folder / f".{SEAL}.tmp"
    tmp.write_text(json.dumps({"files": {name: list(fp) for name, fp in files.items()}}))
    os.replace(tmp, folder / SEAL)
