"""Starting and stopping processes, for the launchers, the elastic supervisor and the checkpoint
commit child: spawning with the output logged, dying with the parent, and, read from /proc, who
is below a launcher, who is alive, who is stopped, and stopping all of them for certain.

torchrun starts every worker in a session of its own (start_new_session), so killing the
launcher's process group does not reach them: the supervisor walks the process tree below
the launcher it started, kills every process by PID, and waits until none is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "MS_LLM_SUPERVISOR_PID"   # the launcher or elastic supervisor: its workers exit when it is gone
REPORT_LINES = 1000       # of a launcher's failure report kept in memory: torchrun's is ~40 per failed rank


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


# Run as `python -S -c _TRAMPOLINE <parent pid> <signal> <command...>`: asks the kernel for the
# signal when the parent dies (PR_SET_PDEATHSIG, kept across exec), gives up if the parent died
# before the call, then becomes the command. It runs in a fresh single-threaded process, where a
# preexec_fn would run between fork and exec in a copy of the threaded supervisor and could
# deadlock on a lock another of its threads held at the fork.
_TRAMPOLINE = ("import ctypes, os, sys\n"
               f"ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, int(sys.argv[2]))\n"
               "if os.getppid() != int(sys.argv[1]):\n"
               "    os._exit(1)\n"
               "os.execvp(sys.argv[3], sys.argv[3:])\n")


def die_with_parent(cmd: list[str], sig: int = signal.SIGKILL) -> list[str]:
    """`cmd` for a launcher the supervisor starts, such that it gets `sig` when the supervisor
    dies, so a killed supervisor leaves no launcher behind (Linux; `cmd` as is elsewhere).
    SIGTERM for one that stops its own children on it (msrun's log tails)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), str(int(sig)), *cmd]


def spawn_logged(cmd: list[str], env: dict[str, str], log: Path, session: bool = True,
                 report: Optional[Callable[[str], bool]] = None) -> subprocess.Popen:
    """Start `cmd`, by default in a session of its own (the elastic supervisor stops it and
    everything below it by PID), dying with this process either way, echoing its merged output to the
    console and to `log` from a thread. From the first line `report` matches on (the launcher's own
    failure report), lines go to `log` alone and to `proc.report`, for the caller to say in a line
    per rank what the console needs of it."""
    try:
        out = open(log, "a")
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
    except OSError:                                       # a full disk: the console still gets the output
        out = None
    # In a session of its own the supervisor stops it by PID (SIGKILL on its death will do); in this
    # one, SIGTERM on the launcher's death lets torchrun stop its workers as it does on Ctrl-C.
    cmd = die_with_parent(cmd) if session else die_with_parent(cmd, signal.SIGTERM)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=session)
    proc.report = []

    def echo() -> None:
        logging = out is not None
        with contextlib.suppress(OSError), out or contextlib.nullcontext():   # closing it on a full disk may fail
            for line in proc.stdout:
                if proc.report or (report is not None and report(line)):
                    if len(proc.report) < REPORT_LINES:
                        proc.report.append(line)
                else:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                if logging:
                    try:
                        out.write(line)
                        out.flush()
                    except OSError:                       # a full disk: the console still gets it
                        logging = False
    proc.echo = threading.Thread(target=echo, name="launcher-output", daemon=True)
    proc.echo.start()
    return proc


def run_logged(cmd: list[str], env: dict[str, str], log: Path,
               report: Optional[Callable[[str], bool]] = None) -> subprocess.Popen:
    """Run `cmd` to its end, as spawn_logged does, in this session (Ctrl-C reaches it); the
    finished process (returncode, report)."""
    proc = spawn_logged(cmd, env, log, session=False, report=report)
    proc.wait()
    proc.echo.join()
    return proc
