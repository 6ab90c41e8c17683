"""The memory-tier keeper: `python -m ms_llm.checkpoint.keeper ROOT --ttl SECONDS`.

Holds an exclusive lock on ROOT/keeper.lock for its lifetime (one keeper per tier), writes
its pid to ROOT/keeper.pid, and removes ROOT when the job wrote ROOT/done or when no save
touched ROOT/heartbeat for --ttl seconds. Started detached by memory_tier.MemoryTier.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import time
from pathlib import Path

from ms_llm.checkpoint.memory_tier import DONE, HEARTBEAT, LOCK, PIDFILE


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


def run(root: Path, ttl_s: float, poll_s: float) -> int:
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"keeper: another keeper holds {root / LOCK}; exiting", flush=True)
        return 0
    (root / PIDFILE).write_text(str(os.getpid()))
    print(f"keeper {os.getpid()}: keeping {root} (ttl {ttl_s:.0f} s)", flush=True)
    while not (reason := should_release(root, ttl_s, time.time())):
        time.sleep(poll_s)
    print(f"keeper {os.getpid()}: releasing {root}: {reason}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ms_llm.checkpoint.keeper", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="the memory tier folder under /dev/shm")
    parser.add_argument("--ttl", type=float, default=3600.0, help="free the tier after this long without a save")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks")
    args = parser.parse_args(argv)
    return run(args.root, args.ttl, args.poll)


if __name__ == "__main__":
    sys.exit(main())
