"""Where a job's worker processes start: this machine's place among the nodes, ports, the
environment of a backend launcher (torchrun, msrun) and what its workers read of it (the
elastic gate, the supervisor to exit with). Shared by ms_llm.launch and the backends' launch
modules; imports no framework. Starting and stopping processes is ms_llm/processes.py."""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ms_llm.errors import ConfigError
from ms_llm.processes import SUPERVISOR_ENV
from ms_llm.run.folder import RunFolder

ROOT = Path(__file__).resolve().parents[1]       # the checkout holding ms_llm and the backends
COLLECTIVE_TIMEOUT_ENV = "MS_LLM_COLLECTIVE_TIMEOUT_S"    # set by the elastic supervisor for its workers
COLLECTIVE_TIMEOUT_S = 600.0                              # otherwise: a dead peer blocks a collective this long
GATE_ENV = "MS_LLM_GATE"         # a standby worker's gate file: it waits, imports done, until the file exists


@dataclass(frozen=True)
class Nodes:
    """This launcher's place among the machines of one job. One node (the default) rendezvouses
    on a port it picks itself; several need node 0's address and a port agreed on beforehand."""
    count: int = 1                        # --nnodes
    rank: int = 0                         # --node-rank: 0 runs on the machine at master_addr
    master_addr: Optional[str] = None     # --master-addr
    master_port: Optional[int] = None     # --master-port

    def check(self) -> None:
        """The flags on their own, one line naming the flag for each problem."""
        if self.count < 1:
            raise ConfigError(f"--nnodes: got {self.count}; give the number of machines (1 or more)")
        if not 0 <= self.rank < self.count:
            raise ConfigError(f"--node-rank: got {self.rank} with --nnodes {self.count}; use 0 to {self.count - 1} "
                              "(0 on the machine at --master-addr)")
        if self.count == 1:
            for flag, value in (("--master-addr", self.master_addr), ("--master-port", self.master_port)):
                if value is not None:
                    raise ConfigError(f"{flag}: only used with --nnodes 2 or more; one machine rendezvouses on a "
                                      "free port of its own")
            return
        if not self.master_addr:
            raise ConfigError(f"--master-addr: required with --nnodes {self.count}: the address of node 0, the same "
                              "on every node")
        if self.master_port is None:
            raise ConfigError(f"--master-port: required with --nnodes {self.count}: a free port on node 0, the same "
                              "on every node")
        if not 1024 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port: got {self.master_port}; use a free port from 1024 to 65535")

    def local(self, world: int) -> int:
        """Processes on this node."""
        if world % self.count:
            raise ConfigError(f"--nnodes: {self.count} nodes do not divide the world size {world}; every node runs "
                              "the same number of processes")
        return world // self.count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout_s() -> float:
    """How long a worker's collective may block before it fails (both backends read this)."""
    try:
        return max(1.0, float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S)))
    except ValueError:
        return COLLECTIVE_TIMEOUT_S


def wait_for_gate() -> bool:
    """A standby worker (started by the elastic supervisor ahead of a failure, its imports done)
    waits here until the supervisor creates its gate file; False when its launcher went away
    instead (the standby was discarded). Without a gate: True at once."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return True
    parent = os.getppid()
    Path(f"{gate}.waiting.{os.getpid()}").touch()     # ready: what the supervisor and bench/elastic.py count
    while not os.path.exists(gate):
        if os.getppid() != parent:
            return False                              # the launcher is gone: nobody will open it
        time.sleep(0.01)
    return True


def exit_with_supervisor() -> None:
    """In a worker: a thread that ends this process the moment the process that started its launch
    (`ms-llm train`, plain or the elastic supervisor) is gone (killed with SIGKILL, its machine
    lost), so no worker outlives it, orphaned.
    A pidfd (not the PID, which the system may reuse) wakes the thread; nothing polls."""
    pid = os.environ.get(SUPERVISOR_ENV)
    if not pid:
        return
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:                        # gone already
        os._exit(1)
    except (OSError, AttributeError):                 # no pidfd (Linux < 5.3, another system): the launcher's
        return                                        # PR_SET_PDEATHSIG and the collective timeout remain

    def watch() -> None:
        select.select([fd], [], [])                   # readable once the supervisor has exited
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-supervisor", daemon=True).start()


def tmp_dir(run: RunFolder, nodes: Nodes) -> Path:
    """One per node: nodes sharing a run folder end at different times."""
    return run.root / "tmp" / f"node{nodes.rank}"


def worker_env(run: RunFolder, nodes: Nodes, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Temporary files (torchrun, inductor) inside the run folder; this interpreter first on PATH
    (msrun starts `python`); this checkout importable; the workers bound to this process's life
    (exit_with_supervisor); `extra` on top (the supervisor's)."""
    tmp = tmp_dir(run, nodes)
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), **{SUPERVISOR_ENV: str(os.getpid())}, **(extra or {}))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def remove_tmp(run: RunFolder, nodes: Nodes) -> None:
    shutil.rmtree(tmp_dir(run, nodes), ignore_errors=True)
    with contextlib.suppress(OSError):                # not empty: another node is still running
        tmp_dir(run, nodes).parent.rmdir()            # the last node out removes tmp/
