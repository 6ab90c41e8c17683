"""The msrun side of `ms-llm train --backend mindspore`: one msrun launch, its progress, the dry run.

ms_llm.launch has resolved the job, asked ms_llm.mindspore.support and written <run>/config.yaml;
this module starts msrun (--join=True, cwd the run folder, worker logs in <run>/logs/, msrun's
own output in <run>/launcher.log) and prints rank 0's progress lines from metrics.jsonl, and a
line per failed rank when workers fail. It imports no MindSpore; the workers and msrun do.

    python -m ms_llm.mindspore.launch --worker_num=W --local_worker_num=W/N --master_addr=HOST
        --master_port=P --node_rank=R --log_dir=RUN/logs --join=True
        python -m ms_llm.mindspore.worker --run-dir RUN

The workers load their start-up graphs from <run>/compile_cache/<key> when an earlier launch
compiled them, or from MS_LLM_COMPILE_CACHE_DIR when another run of the same job did
(ms_llm.mindspore.compile_cache), which takes the compile (most of a launch on CPU) off it.

Running this module is msrun itself (MindSpore's own entry point) with one change: the
scheduler runs on node rank 0, not on every machine that owns --master_addr.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from ms_llm.errors import ConfigError
from ms_llm.job import JobConfig
from ms_llm.mindspore.compile_cache import RUN_ENV, job_cache
from ms_llm.nodes import GATE_ENV, Nodes, collective_timeout_s, free_port, worker_env
from ms_llm.processes import descendants, die_with_parent, kill_all
from ms_llm.run import RunFolder, StepMetrics
from ms_llm.run.heartbeat import failure_lines, read_heartbeats
from ms_llm.run.metrics import read_records, whole_end
from ms_llm.strategy.plan import ModelPlan

WORKER = "ms_llm.mindspore.worker"
# msrun's line for a worker that failed (it names the pid, not the rank)
MSRUN_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")


def msrun_command(run: RunFolder, world: int, nodes: Nodes, port: int, logs: Optional[Path] = None) -> list[str]:
    """msrun for this node's share of `world` workers. One node: 127.0.0.1 and `port`; several:
    --master-addr / --master-port, and msrun numbers ranks from --node-rank, as torchrun does.
    Worker logs in `logs` (default <run>/logs; msrun truncates them when it starts)."""
    if importlib.util.find_spec("mindspore") is None:
        raise ConfigError("--backend mindspore: MindSpore is not installed; install the [mindspore] extra "
                          "(mindspore==2.10.0)")
    addr = nodes.master_addr or "127.0.0.1"
    return [sys.executable, "-m", "ms_llm.mindspore.launch", f"--worker_num={world}",
            f"--local_worker_num={nodes.local(world)}", f"--master_addr={addr}", f"--master_port={port}",
            f"--node_rank={nodes.rank}", f"--log_dir={logs or run.logs}", "--join=True",
            "python", "-m", WORKER, "--run-dir", str(run.root)]


def _follow(run: RunFolder, proc: subprocess.Popen, total: int, every: int, gate: Optional[str]) -> None:
    """Print rank 0's progress lines from metrics.jsonl while msrun runs (lines a previous
    launch wrote are not repeated; a standby's, from its gate's opening on)."""
    while gate and not Path(gate).exists():
        if proc.poll() is not None:
            return
        time.sleep(0.1)
    seen = whole_end(run.metrics)          # whole lines only: a torn tail the workers drop is not counted
    fields = {f.name for f in dataclasses.fields(StepMetrics)} - {"extra"}
    while True:
        done = proc.poll() is not None
        records, seen = read_records(run.metrics, seen)
        for rec in records:
            if "step" in rec and "loss" in rec:
                m = StepMetrics(**{k: v for k, v in rec.items() if k in fields},
                                extra={k: v for k, v in rec.items() if k not in fields})
                if m.step % every == 0 or m.step == total or m.step == 1 or "val_loss" in m.extra:
                    print(m.line(total), flush=True)
        if done:
            return
        time.sleep(0.5)


def spawn(job: JobConfig, run: RunFolder, world: int, nodes: Nodes,
          env: Optional[dict[str, str]] = None, session: bool = True) -> subprocess.Popen:
    """msrun started (by default in a session of its own) and left running, rank 0's progress
    printed from a thread; `env` on top of the workers' environment. One node takes a free port per launch;
    several keep --master-port."""
    env = worker_env(run, nodes, env)
    env.setdefault("GLOG_v", "3")                     # MindSpore: errors only in the worker logs
    # HCCL (Ascend) fails a collective whose peer does not arrive within HCCL_EXEC_TIMEOUT seconds
    # (Atlas training parts round it down to a multiple of 68, at least 68): the same bound as torch's.
    env.setdefault("HCCL_EXEC_TIMEOUT", str(max(68, int(collective_timeout_s()))))
    # On CPU (MindSpore's own ring all-reduce) a send waits MS_CPU_COMM_OP_TIMEOUT seconds for its peer.
    env.setdefault("MS_CPU_COMM_OP_TIMEOUT", str(int(collective_timeout_s())))
    gate = env.get(GATE_ENV)            # a standby's logs apart: msrun would truncate the running launch's
    cmd = msrun_command(run, world, nodes, nodes.master_port or free_port(),          # (it checks MindSpore is there)
                        run.logs / Path(gate).name if gate else None)
    env[RUN_ENV] = str(job_cache(run, world))
    with open(run.launcher_log, "a") as log:
        with contextlib.suppress(OSError):            # a full disk: msrun runs all the same
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
        proc = subprocess.Popen(die_with_parent(cmd, signal.SIGTERM), stdout=log,        # gone with this process
                                stderr=subprocess.STDOUT, env=env, cwd=run.root, start_new_session=session)
    proc.echo = threading.Thread(target=_follow, args=(run, proc, job.train.steps, job.train.log_every, gate),
                                 name="msrun-progress", daemon=True)
    proc.echo.start()
    return proc


def start(job: JobConfig, run: RunFolder, world: int, nodes: Nodes) -> int:
    """One msrun launch of this node's workers (in this session: Ctrl-C reaches it); returns
    msrun's exit status, and for a failure prints a line per failed rank (msrun's own report
    and the workers' tracebacks stay in the logs)."""
    since, offset = time.time(), _size(run.launcher_log)
    proc = spawn(job, run, world, nodes, session=False)
    proc.wait()
    proc.echo.join()
    if proc.returncode != 0:
        for line in failure_lines(run.heartbeat, since, msrun_exits(run, offset)):
            print(f"ms-llm train: {line}", file=sys.stderr, flush=True)
    return proc.returncode


def msrun_exits(run: RunFolder, offset: int) -> dict[int, int]:
    """rank -> exit status of each worker msrun saw fail, from what it wrote to launcher.log past
    `offset` (its last MiB: msrun also copies the worker logs there), the rank found by the pid in
    the heartbeats. Empty when the log could not be written (a full disk)."""
    try:
        with open(run.launcher_log, "rb") as log:
            log.seek(max(offset, _size(run.launcher_log) - (1 << 20)))
            text = log.read(1 << 20).decode(errors="replace")
    except OSError:
        return {}
    ranks = {b.get("pid"): rank for rank, b in read_heartbeats(run.heartbeat).items()}
    return {ranks[int(pid)]: int(code) for pid, code in MSRUN_EXIT.findall(text) if int(pid) in ranks}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dry_run(p: ModelPlan, run_dir: Optional[Path]) -> int:
    """Print the lowering without compiling; with a run folder also write the strategy files
    MindSpore would save, for its checkpoint tools."""
    from ms_llm.mindspore.dry_run import dry_run_text
    from ms_llm.mindspore.lower import lower, write_strategy_files

    print(dry_run_text(lower(p)))
    if run_dir is not None:
        files = write_strategy_files(p, Path(run_dir) / "strategy")
        print(f"wrote {len(files)} strategy files to {Path(run_dir) / 'strategy'}")
    return 0


def msrun_main() -> None:
    """msrun with its scheduler on node rank 0 (msrun itself starts one on every machine that
    owns --master_addr: with two node ranks on one machine the second scheduler finds the
    port taken, and that node's msrun exits 1 after its workers trained), and stopping every
    process it started on SIGTERM."""
    from mindspore.parallel.cluster.process_entity import _ProcessManager
    from mindspore.parallel.cluster.run import get_args

    args = get_args()
    manager = _ProcessManager(args)
    manager.is_master = args.node_rank in (0, -1)

    def stop(signum, frame):        # SIGTERM: the supervisor is gone (PR_SET_PDEATHSIG); take every child along
        kill_all(descendants(os.getpid()))          # workers, the scheduler and msrun's `tail -f` of their logs
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    manager.run()


if __name__ == "__main__":
    msrun_main()
