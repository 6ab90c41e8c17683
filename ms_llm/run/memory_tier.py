"""In-memory checkpoint tier (Gemini-style): the last snapshot also lives in /dev/shm.

The writer publishes each save to <shm root> with the same format and the same atomic
commit as on disk, before the (slower) disk copy, so a restart after a process crash
loads from memory when the memory copy is at least as new as the disk one and reads
cleanly (checksums), and from disk otherwise (`restore_folders`).

The files belong to a keeper process, not to the trainers: rank 0 starts it detached
(its own session, so a launcher killing the worker group leaves it alone) and it outlives
trainer crashes. It verifies each committed snapshot once and seals it (seal.py), so a
restore from memory reads the files without a second checksum pass. It removes the tier
when the job says it finished (`finish()`) or when no save has refreshed the heartbeat for
`ttl_s` (the job is gone). Single node for now: a multi-node job would need each node's
shards replicated to a peer node, which is where a peer-replica step plugs into the
keeper's loop.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ms_llm.checkpoint.reader import candidates
from ms_llm.checkpoint.storage import commit as commit_mod
from ms_llm.checkpoint.storage.seal import KEEPER_LOCK as LOCK
from ms_llm.errors import CheckpointError

SHM_BASE = Path("/dev/shm/ms_llm")
HEARTBEAT = "heartbeat"
DONE = "done"
PIDFILE = "keeper.pid"


@dataclass
class MemoryTier:
    root: Path
    keep_last: int = 1
    ttl_s: float = 3600.0
    local_world_size: Optional[int] = None   # ranks on this node; None = all ranks

    @classmethod
    def for_run(cls, job_name: str, run_root: str | Path, **kwargs) -> "MemoryTier":
        """The tier of one run folder on this machine: named by the job and the folder's path,
        so the trainers, the launcher and `ms-llm clean` all find the same one."""
        folder = str(Path(run_root).resolve())
        return cls.for_job(f"{job_name}-{zlib.crc32(folder.encode()):08x}", **kwargs)

    @classmethod
    def for_job(cls, job_id: str, **kwargs) -> "MemoryTier":
        if not job_id or "/" in job_id:
            raise CheckpointError(f"memory tier: job id {job_id!r} must be a non-empty name without '/'")
        return cls(SHM_BASE / job_id, **kwargs)

    def attach(self, rank: int, world_size: int) -> None:
        """Called by the writer: rank 0 makes sure a keeper runs."""
        if self.local_world_size is not None and self.local_world_size != world_size:
            raise CheckpointError(f"memory tier: the job spans several nodes ({world_size} ranks, "
                                  f"{self.local_world_size} on this node); the in-memory tier is single-node, "
                                  "set train.checkpoint.memory_tier: false")
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            self.heartbeat()
            (self.root / DONE).unlink(missing_ok=True)
            self.start_keeper()

    def heartbeat(self) -> None:
        (self.root / HEARTBEAT).touch()

    def finish(self) -> None:
        """The job ended normally: the keeper frees the memory and exits."""
        (self.root / DONE).touch()

    def release(self, timeout_s: float = 10.0) -> bool:
        """Free the tier now (the run ended, or `ms-llm clean`): its keeper is told and removes the
        folder as it exits; with no keeper the folder is removed here. False when there was none."""
        if not Path(self.root).is_dir():
            return False
        if self.keeper_running():
            self.finish()
            deadline = time.monotonic() + timeout_s
            while Path(self.root).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):         # the last tier out removes the shared base folder
            Path(self.root).parent.rmdir()
        return True

    def latest(self) -> Optional[Path]:
        return commit_mod.latest(self.root) if Path(self.root).is_dir() else None

    def keeper_pid(self) -> Optional[int]:
        try:
            return int((self.root / PIDFILE).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def keeper_running(self) -> bool:
        """True while some process holds the keeper lock."""
        try:
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def start_keeper(self, timeout_s: float = 60.0) -> Optional[int]:
        """Start a detached keeper unless one runs; return once it holds the tier (its pid)."""
        if self.keeper_running():
            return None
        (self.root / PIDFILE).unlink(missing_ok=True)
        with open(self.root / "keeper.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "ms_llm.run.keeper", str(self.root),
                                     "--ttl", str(self.ttl_s)], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + timeout_s
        while self.keeper_pid() != proc.pid:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CheckpointError(f"memory tier: the keeper did not start (see {self.root / 'keeper.log'}); "
                                      "set train.checkpoint.memory_tier: false to run without it")
            time.sleep(0.02)
        return proc.pid


def restore_folders(disk_root: str | Path, memory: Optional[MemoryTier] = None) -> list[Path]:
    """Folders to restore from, best first: the memory tier when it is at least as new as
    the disk, then disk checkpoints newest first (reader.load_with_fallback walks them)."""
    return candidates(memory.root if memory is not None else None, disk_root)
