"""The torchrun side of `ms-llm train --backend torch`: one torchrun launch of this node's workers.

ms_llm.launch has resolved the job, asked torch_backend.support and written <run>/config.yaml;
this module starts torchrun (worker logs in <run>/logs/, its output on the console and in
<run>/launcher.log). It imports no torch; the workers do.

    torchrun --standalone --nproc-per-node W ... -m torch_backend.worker --run-dir RUN
"""
from __future__ import annotations

import subprocess
import sys
from typing import Optional

from ms_llm.job import JobConfig
from ms_llm.nodes import Nodes, worker_env
from ms_llm.processes import run_logged, spawn_logged
from ms_llm.run import RunFolder


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


def start(job: JobConfig, run: RunFolder, world: int, nodes: Nodes) -> int:
    """One torchrun launch of this node's workers; returns its exit status."""
    return run_logged(torch_command(run, world, nodes), worker_env(run, nodes), run.launcher_log)


def spawn(job: JobConfig, run: RunFolder, world: int, nodes: Nodes,
          env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """torchrun started and left running, for the elastic supervisor (ms_llm.elastic); `env` on
    top of the workers' environment."""
    return spawn_logged(torch_command(run, world, nodes), worker_env(run, nodes, env), run.launcher_log)
