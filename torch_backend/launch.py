"""The torchrun side of `ms-llm train --backend torch`: one torchrun launch of this node's workers.

ms_llm.launch has resolved the job, asked torch_backend.support and written <run>/config.yaml;
this module starts torchrun (worker logs in <run>/logs/, its output on the console and in
<run>/launcher.log). When workers fail, torchrun's own report (a traceback and a block per
rank) goes to launcher.log alone; the console gets one line per failed rank. It imports no
torch; the workers do.

    torchrun --standalone --nproc-per-node W ... -m torch_backend.worker --run-dir RUN
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Optional

from ms_llm.job import JobConfig
from ms_llm.nodes import Nodes, worker_env
from ms_llm.processes import run_logged, spawn_logged
from ms_llm.run import RunFolder
from ms_llm.run.heartbeat import failure_lines

# The first line of torchrun's own failure report: its agent stopping the workers or logging a
# failed one, or its ChildFailedError traceback (worker lines carry a [rankN]: prefix).
REPORT = re.compile(r"[IWE]\d{4} .*\] (Sending process \d+ closing signal|failed \(exitcode)|Traceback \(most recent")
# A failed rank in the ChildFailedError block: "rank      : 1 (local_rank: 1)" then "exitcode  : -15 (pid: 42)".
EXIT = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", re.M)


def torchrun(world: int, nodes: Nodes = Nodes()) -> list[str]:
    """torchrun for this node's share of `world` processes.

    One node: --standalone rendezvouses on a port the agent's store binds itself (port 0), so no
    other process can take it in between, as can happen with a free port picked beforehand.
    Several: the static rendezvous. Global ranks follow --node-rank, as under msrun, and node 0's
    agent alone hosts the store. c10d numbers nodes in the order they join, and on a machine
    that owns the endpoint (two nodes on one host) every agent tries to host it."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    if nodes.count == 1:
        return [*head, "--standalone", f"--nproc-per-node={world}"]
    return [*head, f"--nnodes={nodes.count}", f"--node-rank={nodes.rank}", f"--nproc-per-node={nodes.local(world)}",
            f"--master-addr={nodes.master_addr}", f"--master-port={nodes.master_port}"]


def torch_command(run: RunFolder, world: int, nodes: Nodes) -> list[str]:
    return [*torchrun(world, nodes), f"--log-dir={run.logs}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
            "--role=rank", "-m", "torch_backend.worker", "--run-dir", str(run.root)]


def torchrun_report(line: str) -> bool:
    return REPORT.match(line) is not None


def exits(report: list[str]) -> dict[int, int]:
    """rank -> exit status (negative: the signal) of each failed rank torchrun's report names."""
    return {int(rank): int(code) for rank, code in EXIT.findall("".join(report))}


def start(job: JobConfig, run: RunFolder, world: int, nodes: Nodes) -> int:
    """One torchrun launch of this node's workers; returns its exit status, and for a failure
    prints a line per failed rank in place of torchrun's report."""
    since = time.time()
    proc = run_logged(torch_command(run, world, nodes), worker_env(run, nodes), run.launcher_log, torchrun_report)
    if proc.returncode != 0:
        for line in failure_lines(run.heartbeat, since, exits(proc.report)):
            print(f"ms-llm train: {line}", file=sys.stderr, flush=True)
    return proc.returncode


def spawn(job: JobConfig, run: RunFolder, world: int, nodes: Nodes,
          env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """torchrun started and left running, for the elastic supervisor (ms_llm.elastic); `env` on
    top of the workers' environment."""
    return spawn_logged(torch_command(run, world, nodes), worker_env(run, nodes, env), run.launcher_log,
                        report=torchrun_report)
