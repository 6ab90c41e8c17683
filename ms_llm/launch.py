"""`ms-llm train`: validate a job, create its run folder and start its workers on this machine.

The launcher imports no framework: it plans (so a bad strategy fails here, before any
process starts), then runs the backend's own launcher as a subprocess and copies its
output to the console and to <run>/launcher.log. Worker logs go to <run>/logs/.

    torch:  torchrun --standalone --nproc-per-node W --log-dir <run>/logs --redirects 3 --tee 3
                     --local-ranks-filter 0 -m torch_backend.worker CONFIG --run-dir <run>

With --max-restarts N a failed launch is started again (ms_llm.elastic) up to N times.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ms_llm.config.job import JobConfig, load_job
from ms_llm.elastic import check_restarts, with_restarts
from ms_llm.errors import ConfigError, StrategyError
from ms_llm.run import RunFolder
from ms_llm.strategy.plan import ModelPlan, plan

ROOT = Path(__file__).resolve().parents[1]       # the checkout holding ms_llm and the backends


@dataclass(frozen=True)
class TrainRequest:
    config: Path
    backend: Optional[str] = None      # None: the job's own `backend`
    nproc: Optional[int] = None        # processes on this machine; None: the strategy's world size
    run_dir: Optional[Path] = None     # None: runs/<name>-<time>
    steps: Optional[int] = None        # override train.steps
    dry_run: bool = False              # print the lowering, start nothing
    max_restarts: int = 0              # start failed workers again, resuming from the newest checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int) -> list[str]:
    """torchrun for `world` processes on this machine. --standalone rendezvouses on a port the
    agent's store binds itself (port 0), so no other process can take it in between, as can
    happen with a free port picked beforehand."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]


def world_size(job: JobConfig, nproc: Optional[int]) -> int:
    """Processes the strategy needs. `--nproc` fills dp = -1 (one replica without it) and must
    agree with a fixed dp."""
    s = job.strategy
    if s.dp == -1:
        return nproc if nproc is not None else s.model_parallel_size
    world = s.world_size()
    if nproc is not None and nproc != world:
        raise StrategyError(f"--nproc: {nproc} processes, but dp*tp*pp*cp = {s.dp}*{s.tp}*{s.pp}*{s.cp} = {world}; "
                            "drop --nproc or change the strategy (several machines: start torchrun on each, "
                            "see README)")
    return world


def torch_command(req: TrainRequest, run: RunFolder, world: int) -> list[str]:
    cmd = [*torchrun(world), f"--log-dir={run.logs}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
           "--role=rank", "-m", "torch_backend.worker", str(Path(req.config).resolve()), "--run-dir", str(run.root)]
    if req.steps is not None:
        cmd += ["--steps", str(req.steps)]
    return cmd


def worker_env(run: RunFolder) -> dict[str, str]:
    """Temporary files (torchrun, inductor) inside the run folder; this checkout importable."""
    tmp = run.root / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_logged(cmd: list[str], env: dict[str, str], log: Path) -> int:
    """Run `cmd`, echoing its merged output to the console and to `log`."""
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            out.write(line)
        return proc.wait()


# Backend -> the command that starts its workers for (request, run folder, world size).
COMMANDS = {"torch": torch_command}


def absolute_paths(job: JobConfig) -> JobConfig:
    """The job's file paths as the launching shell means them (workers may start elsewhere:
    msrun starts them in the run folder), checked before any process starts."""
    t = job.train
    load, source = t.checkpoint.load, t.data.source
    if load:
        if not Path(load).exists():
            raise ConfigError(f"train.checkpoint.load: {load} does not exist (relative to {Path.cwd()})")
        load = str(Path(load).resolve())
    if source != "stdlib":
        if not Path(source).is_file():
            raise ConfigError(f"train.data.source: token file {source} does not exist (relative to {Path.cwd()}); "
                              "give a token file or 'stdlib'")
        source = str(Path(source).resolve())
    train = dataclasses.replace(t, checkpoint=dataclasses.replace(t.checkpoint, load=load),
                                data=dataclasses.replace(t.data, source=source))
    return dataclasses.replace(job, train=train)


def prepare(req: TrainRequest) -> tuple[JobConfig, ModelPlan, str]:
    job = absolute_paths(load_job(req.config))
    if req.steps is not None:
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=req.steps))
    backend = req.backend or job.backend
    if backend not in COMMANDS and backend != "mindspore":
        raise ConfigError(f"--backend: {backend!r} cannot train from this launcher; available: {', '.join(COMMANDS)}")
    check_restarts(job, req.max_restarts)
    return job, plan(job.model, job.strategy, job.train, world_size(job, req.nproc)), backend


def train(req: TrainRequest) -> int:
    job, p, backend = prepare(req)
    if backend == "mindspore":
        # msrun, the CPU data-parallel runtime and the Ascend checks live with the backend.
        from ms_llm.mindspore.launch import cli_train
        return cli_train(job, req.run_dir, p.world_size, req.dry_run, req.max_restarts)
    if req.dry_run:
        from ms_llm.strategy.cost import estimate
        from ms_llm.strategy.devices import get_device
        from ms_llm.strategy.report import plan_report
        print(plan_report(p, estimate(p, get_device(job.device)), get_device(job.device)))
        return 0
    run = RunFolder.create(job.name, req.run_dir)
    print(f"ms-llm train: {job.name} on {backend}, {p.world_size} process(es), mesh {p.mesh.describe()}, "
          f"run folder {run.root}", flush=True)
    env = worker_env(run)
    rc = with_restarts(lambda: run_logged(COMMANDS[backend](req, run, p.world_size), env, run.launcher_log),
                       req.max_restarts, run)
    shutil.rmtree(run.root / "tmp", ignore_errors=True)
    if rc != 0:
        print(f"ms-llm train: workers failed (exit {rc}); logs in {run.logs} and {run.launcher_log}",
              file=sys.stderr)
    return rc
