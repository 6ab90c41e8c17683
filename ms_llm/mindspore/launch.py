"""`ms-llm train --backend mindspore`: check the strategy, prepare the run folder, start msrun.

This module imports no MindSpore; the workers do. On a CPU machine MindSpore refuses to
compile semi_auto_parallel graphs, so only data parallel (+ ZeRO stages 1-3, the shared
engine over MindSpore's CPU AllReduce/AllGather) runs here, under msrun --join=True on a free
port, logs in the run folder. Other strategies fail before any process starts, with the
reason and what to use instead; `--dry-run` prints their lowering without compiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ms_llm.config.job import JobConfig, dump_yaml, job_to_dict, load_job
from ms_llm.data import build_stdlib_corpus
from ms_llm.errors import ConfigError, StrategyError
from ms_llm.elastic import with_restarts
from ms_llm.launch import free_port
from ms_llm.run import RunFolder, StepMetrics
from ms_llm.strategy.plan import ModelPlan, plan

ROOT = Path(__file__).resolve().parents[2]
CPU_WORKER = "ms_llm.mindspore.worker"           # DATA_PARALLEL + our ZeRO engine
AUTO_WORKER = "ms_llm.mindspore.auto_worker"     # semi_auto_parallel from the lowering (Ascend)


def cpu_runtime_problems(p: ModelPlan) -> list[str]:
    """Why `p` cannot train with MindSpore on a CPU machine (empty: it can)."""
    s = p.strategy
    needs_auto = [f"{n}={getattr(s, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(s, n) > 1]
    if s.sequence_parallel:
        needs_auto.append("sequence_parallel")
    problems = []
    if needs_auto:
        problems.append(
            f"strategy: {', '.join(needs_auto)} needs MindSpore's semi_auto_parallel, which MindSpore compiles "
            "only on Ascend (or GPU): on CPU it stops with 'Invalid communication backend'. Here use data "
            "parallel (dp, zero.stage 1-3), run the same command on an Ascend machine, use --backend torch, "
            "or add --dry-run to print the lowering")
    if s.zero.stage >= 1 and s.zero.engine == "native":
        problems.append("strategy.zero.engine: 'native' is MindSpore's parallel optimizer, Ascend only; on CPU "
                        "use engine 'shared' or 'auto' (ms_llm's ZeRO engine)")
    prec = s.precision
    if (prec.param_dtype, prec.compute_dtype) != ("float32", "float32"):
        problems.append(f"strategy.precision: the MindSpore CPU runtime trains in float32 (MindSpore has no bfloat16 "
                        f"MatMul on CPU), got param_dtype {prec.param_dtype}, compute_dtype {prec.compute_dtype}; "
                        "set both to float32 (Ascend runs the mixed-precision path)")
    if s.offload.optimizer or s.offload.params:
        problems.append("strategy.offload: the MindSpore CPU runtime has no offload (everything is host memory "
                        "already); remove it")
    return problems


def ascend_available() -> bool:
    return Path("/dev/davinci0").exists()


def token_file(job: JobConfig, run: RunFolder) -> Path:
    """The token file the workers read (ms_llm.launch checked and made the job's path absolute)."""
    if job.train.data.source == "stdlib":
        return build_stdlib_corpus(run.data)
    return Path(job.train.data.source)


def resolved_job(job: JobConfig, p: ModelPlan) -> JobConfig:
    return dataclasses.replace(job, backend="mindspore", strategy=p.strategy)


def worker_env() -> dict:
    """msrun starts `python` from PATH: put this interpreter's folder first, this checkout on PYTHONPATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("GLOG_v", "3")                     # MindSpore: errors only in the worker logs
    return env


def msrun_command(world: int, port: int, run: RunFolder, config: Path, tokens: Path, worker: str) -> list[str]:
    msrun = shutil.which("msrun", path=worker_env()["PATH"])
    if msrun is None:
        raise ConfigError("--backend mindspore: msrun not found; install the [mindspore] extra (mindspore==2.10.0)")
    return [msrun, f"--worker_num={world}", f"--local_worker_num={world}", "--master_addr=127.0.0.1",
            f"--master_port={port}", f"--log_dir={run.logs}", "--join=True", "python", "-m", worker,
            "--config", str(config), "--run-dir", str(run.root), "--tokens", str(tokens)]


def worker_args(argv: list[str] | None, description: str) -> tuple[JobConfig, RunFolder, Path]:
    """What msrun_command hands a worker: its job, run folder and token file."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--tokens", required=True)
    args = ap.parse_args(argv)
    return load_job(args.config), RunFolder(Path(args.run_dir)), Path(args.tokens)


def _follow(run: RunFolder, proc: subprocess.Popen, total: int, every: int) -> None:
    """Print rank 0's progress lines from metrics.jsonl while msrun runs (lines a previous
    launch wrote are not repeated)."""
    seen = len(run.metrics.read_text().splitlines()) if run.metrics.is_file() else 0
    while True:
        done = proc.poll() is not None
        if run.metrics.is_file():
            lines = run.metrics.read_text().splitlines()
            for line in lines[seen:]:
                rec = json.loads(line)
                if "step" in rec and "loss" in rec:
                    m = StepMetrics(**{k: rec[k] for k in ("step", "loss", "lr", "tokens_per_s", "mfu", "memory_gb",
                                                           "grad_norm", "step_time_s")})
                    if m.step % every == 0 or m.step == total or m.step == 1:
                        print(m.line(total), flush=True)
            seen = len(lines)
        if done:
            return
        time.sleep(0.5)


def train(job: JobConfig, run_dir: str | None = None, world_size: int | None = None, max_restarts: int = 0) -> int:
    """Train `job` with MindSpore; returns the exit status of msrun (of its last launch)."""
    p = plan(job.model, job.strategy, job.train, world_size)
    ascend = ascend_available()
    if not ascend:
        problems = cpu_runtime_problems(p)
        if problems:
            raise StrategyError(problems)
    run = RunFolder.create(job.name, run_dir)
    run.config.write_text(dump_yaml(job_to_dict(resolved_job(job, p))))
    tokens = token_file(job, run)
    env = worker_env()
    mode = "semi_auto_parallel on Ascend" if ascend else "DATA_PARALLEL on CPU"
    print(f"ms-llm train: MindSpore {mode}, {p.world_size} workers (msrun), run folder {run.root}", flush=True)

    def launch() -> int:
        cmd = msrun_command(p.world_size, free_port(), run, run.config, tokens, AUTO_WORKER if ascend else CPU_WORKER)
        with open(run.launcher_log, "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run.root)
            _follow(run, proc, job.train.steps, job.train.log_every)
        if proc.returncode != 0:
            worker0 = run.logs / "worker_0.log"
            tail = worker0.read_text().splitlines()[-15:] if worker0.is_file() else []
            print(f"ms-llm train: msrun exited with {proc.returncode}; logs in {run.logs} and {run.launcher_log}",
                  file=sys.stderr)
            for line in tail:
                print(f"  {line}", file=sys.stderr)
        return proc.returncode
    return with_restarts(launch, max_restarts, run)


def cli_train(job: JobConfig, run_dir: str | None = None, world_size: int | None = None, dry_run: bool = False,
              max_restarts: int = 0) -> int:
    if dry_run:
        from ms_llm.mindspore.dry_run import dry_run_text
        from ms_llm.mindspore.lower import lower

        p = plan(job.model, job.strategy, job.train, world_size)
        print(dry_run_text(lower(p)))
        if run_dir is not None:             # the strategy files MindSpore would save, for its checkpoint tools
            from ms_llm.mindspore.lower import write_strategy_files

            files = write_strategy_files(p, Path(run_dir) / "strategy")
            print(f"wrote {len(files)} strategy files to {Path(run_dir) / 'strategy'}")
        return 0
    return train(job, run_dir, world_size, max_restarts)
