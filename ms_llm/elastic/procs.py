"""The processes a supervisor started, read from /proc: who is below the launcher, who is
alive, who is stopped, and stopping all of them for certain.

torchrun starts every worker in a session of its own (start_new_session), so killing the
launcher's process group does not reach them: the supervisor walks the process tree below
the launcher it started, kills every process by PID, and waits until none is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of `pid`, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not gone and not a zombie waiting to be reaped."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    st = _stat(pid)
    return st is not None and st[0] in ("T", "t")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[1], []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def kill_all(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every pid (a stopped one too: SIGKILL needs no SIGCONT) and wait until each is
    gone or a zombie; returns those still alive after `timeout_s` (empty on success)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):      # already gone: nothing to stop
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left
