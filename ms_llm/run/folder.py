"""One folder per run: launcher and worker logs, metrics.jsonl, the resolved config, checkpoints.

    runs/<name>-<YYYYmmdd-HHMMSS>/
        config.yaml        the job as resolved (dp, micro-batches filled in)
        launcher.log       what the launcher (torchrun / msrun) printed
        logs/              one log per worker
        metrics.jsonl      one JSON object per logged step (rank 0)
        checkpoints/       step-N folders and the `latest` pointer
        heartbeat/         one liveness file per rank (ms_llm.run.heartbeat)
        data/              the tokenized default corpus cache
        compile_cache/     MindSpore's compiled graphs, one folder per job, world and version
        .lock.node<R>      who holds the folder (RunLock): one job per folder and node
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ms_llm.errors import CheckpointError, RunFolderError

NO_CHECKPOINT_NEEDS = 1 << 20      # bytes a first checkpoint is assumed to need, none being there to measure


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def create(cls, name: str, run_dir: str | Path | None = None, base: str | Path = "runs") -> "RunFolder":
        root = Path(run_dir) if run_dir else Path(base) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder = cls(root.resolve())
        try:
            for sub in (folder.logs, folder.checkpoints, folder.data):
                sub.mkdir(parents=True, exist_ok=True)
            folder.probe_write()
        except OSError as exc:
            raise RunFolderError(f"run folder {folder.root}: cannot write there ({exc.strerror or exc}); "
                                 "pick another --run-dir or free space") from None
        return folder

    def probe_write(self) -> None:
        """Write, fsync and remove a small file: a read-only or full disk fails here, before the
        workers start, rather than in the middle of a run."""
        probe = self.root / f".write_probe.{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)

    def disk_problem(self) -> Optional[str]:
        """Why the folder cannot take the next checkpoint, or None: too little space for one as
        large as the newest, or no write succeeds. A full disk fails every write of a run (a shard,
        a heartbeat, a log), whichever comes first, so the workers may have said nothing of it;
        the launchers ask here after a failure. Partial saves count as free: the next start
        removes them."""
        from ms_llm.checkpoint.storage.commit import latest      # the checkpoint package: only after a failure

        try:
            newest = latest(self.checkpoints)
        except (OSError, CheckpointError):        # a bad pointer is the resume's to handle (it falls back)
            newest = None
        need = _bytes(newest) if newest is not None else NO_CHECKPOINT_NEEDS
        try:
            free = shutil.disk_usage(self.root).free + sum(_bytes(d) for d in self.checkpoints.glob("step_*.tmp"))
        except OSError as exc:
            return f"the run folder {self.root} cannot be read ({exc.strerror or exc})"
        if free < need:
            return (f"the disk is full: {self.root} has {free:,} bytes free (counting partial saves), a "
                    f"checkpoint needs {need:,}")
        try:
            self.probe_write()
        except OSError as exc:
            return f"the run folder {self.root} cannot be written ({exc.strerror or exc})"
        return None

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat"

    @property
    def compile_cache(self) -> Path:
        return self.root / "compile_cache"

    @property
    def launcher_log(self) -> Path:
        return self.root / "launcher.log"


def _bytes(folder: Path) -> int:
    """Bytes of the files directly in `folder` (a checkpoint's are), 0 once it is gone."""
    with contextlib.suppress(FileNotFoundError):           # removed meanwhile (retention, a restart)
        return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return 0


class RunLock:
    """An exclusive lock on a run folder for the life of one job on one node: a second job there
    would delete the first's checkpoint temp folders, race its heartbeat renames and record every
    step twice. flock on <run>/.lock.node<R>, which holds the holder's pid, host and start; the
    kernel drops the lock when its holder dies, so a killed job leaves no stale lock. Node ranks
    lock apart: the nodes of one job share the folder."""

    def __init__(self, run: RunFolder, node_rank: int = 0):
        self.path = run.root / f".lock.node{node_rank}"
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunFolderError(f"run folder {self.path.parent}: cannot create {self.path.name} "
                                 f"({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder(fd)
            os.close(fd)
            raise RunFolderError(f"run folder {self.path.parent} is in use by {holder}; wait for that job or stop "
                                 "it, or give another --run-dir") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def holder(fd: int) -> str:
        """'pid P on host H since T' from the lock file (what a holder that just took it has not
        yet written is 'another job')."""
        try:
            h = json.loads(os.pread(fd, 4096, 0))
            since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(h["since"])))
            return f"pid {int(h['pid'])} on host {h['host']} since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another job"

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):       # a full disk: the lock goes with the descriptor
                os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
