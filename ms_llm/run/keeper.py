"""The memory-tier keeper: `python -m ms_llm.run.keeper ROOT --ttl SECONDS`.

Holds an exclusive lock on ROOT/keeper.lock for its lifetime (one keeper per tier), writes
its pid to ROOT/keeper.pid, verifies every checksum of each newly committed checkpoint once
and seals it (seal.py: a restore then reads it without a second checksum pass), and removes
ROOT when the job wrote ROOT/done, when no save touched ROOT/heartbeat for --ttl seconds, or
at once when the `ms-llm train` process the job runs under (plain launcher or elastic
supervisor, its pid in the environment rank 0 passed on) is gone, killed outright included.
Started detached by memory_tier.MemoryTier: it outlives a crashed trainer, not its launch.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import select
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.storage import commit as commit_mod
from ms_llm.checkpoint.storage.seal import SEAL, fingerprint, write_seal
from ms_llm.errors import CheckpointError
from ms_llm.processes import SUPERVISOR_ENV
from ms_llm.run.memory_tier import DONE, HEARTBEAT, LOCK, PIDFILE


def should_release(root: Path, ttl_s: float, now: float) -> str:
    """Why the tier should be freed now, or '' to keep it."""
    if not root.is_dir():
        return "its folder is gone"
    if (root / DONE).exists():
        return "the job finished"
    try:
        idle = now - (root / HEARTBEAT).stat().st_mtime
    except FileNotFoundError:
        return "no heartbeat file"
    return f"no save for {idle:.0f} s" if idle > ttl_s else ""


def seal_new(root: Path, failed: set[Path]) -> None:
    """Verify and seal the committed checkpoints that have no seal yet. A folder that fails
    is reported once and left unsealed: restores check it block by block and fall back."""
    for folder in commit_mod.committed(root):
        if folder in failed or (folder / SEAL).exists():
            continue
        try:
            with Checkpoint(folder) as ckpt:
                files = sorted({s.file for e in ckpt.index.tensors.values() for s in e.shards})
                before = {f: fingerprint(os.stat(folder / f)) for f in files}
                ckpt.verify()
            if before == {f: fingerprint(os.stat(folder / f)) for f in files}:
                write_seal(folder, before)
        except (CheckpointError, OSError) as exc:    # corrupted, or removed by retention meanwhile
            if folder.is_dir():
                print(f"keeper {os.getpid()}: {folder.name} not sealed: {exc}", flush=True)
            failed.add(folder)


def watch_launcher() -> tuple[Optional[int], str]:
    """(a pidfd of the launch's `ms-llm train` process, readable once it has exited; None when
    there is none to watch) and why to release now ('' unless it is gone already). A pidfd, not
    the pid, which the system may give to another process."""
    pid = os.environ.get(SUPERVISOR_ENV)
    if not pid:
        return None, ""
    try:
        return os.pidfd_open(int(pid)), ""
    except ProcessLookupError:
        return None, f"its launcher (pid {pid}) is gone"
    except (OSError, ValueError, AttributeError):      # no pidfd (Linux < 5.3): the ttl remains
        return None, ""


def wait(launcher: Optional[int], poll_s: float) -> str:
    """Sleep `poll_s`, woken at once when the launcher exits: then why to release."""
    if launcher is None:
        time.sleep(poll_s)
        return ""
    return "its launcher is gone" if select.select([launcher], [], [], poll_s)[0] else ""


def run(root: Path, ttl_s: float, poll_s: float) -> int:
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"keeper: another keeper holds {root / LOCK}; exiting", flush=True)
        return 0
    (root / PIDFILE).write_text(str(os.getpid()))
    print(f"keeper {os.getpid()}: keeping {root} (ttl {ttl_s:.0f} s)", flush=True)
    failed: set[Path] = set()
    launcher, reason = watch_launcher()
    while not reason and not (reason := should_release(root, ttl_s, time.time())):
        seal_new(root, failed)
        reason = wait(launcher, poll_s)
    print(f"keeper {os.getpid()}: releasing {root}: {reason}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(OSError):             # the last tier out removes the shared base folder
        root.parent.rmdir()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ms_llm.run.keeper", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="the memory tier folder under /dev/shm")
    parser.add_argument("--ttl", type=float, default=3600.0, help="free the tier after this long without a save")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks")
    args = parser.parse_args(argv)
    return run(args.root, args.ttl, args.poll)


if __name__ == "__main__":
    sys.exit(main())
