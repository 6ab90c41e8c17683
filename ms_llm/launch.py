"""`ms-llm train`: resolve a job once, write it to the run folder, start this node's workers.

The launcher imports no framework. Before any process starts it resolves the job for both
backends alike: overrides, checked absolute paths, the stdlib corpus built, dp and
micro-batches planned for the world size, the backend asked whether it can run the plan.
The result is <run>/config.yaml, and the workers start from the run folder alone:

    torch:      torchrun --standalone --nproc-per-node W ... -m torch_backend.worker --run-dir RUN
    mindspore:  msrun --worker_num=W --local_worker_num=W ... python -m ms_llm.mindspore.worker --run-dir RUN
                (msrun as python -m ms_llm.mindspore.launch: the scheduler on node rank 0)

Several machines: the same command on each, `--nnodes N --node-rank R --master-addr HOST
--master-port P --run-dir RUN`; node R runs global ranks R*W/N .. (R+1)*W/N - 1 and node 0
hosts the rendezvous. Every node resolves the same YAML the same way, so each writes the
same config.yaml (atomically: nodes may share the folder). The backend's launcher's output
goes to the console and <run>/launcher.log, worker logs to <run>/logs/; when workers fail, the
console gets a line per failed rank and a last line with the cause (a full disk named with its
bytes), the launcher's own report going to launcher.log alone. With
--max-restarts N a failed launch is started again (ms_llm.elastic) up to N times; with
--elastic a supervisor owns the job (ms_llm.elastic.supervisor: hang detection, no retry of
failures that repeat, shrink and grow, recovery time in metrics.jsonl).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ms_llm.backends import BACKENDS, check
from ms_llm.config.train import DataConfig
from ms_llm.data import IndexedDataset, build_stdlib_corpus, samples
from ms_llm.elastic import check_restarts, with_restarts
from ms_llm.elastic.supervisor import ElasticOptions
from ms_llm.errors import ConfigError, RunFolderError, StrategyError
from ms_llm.job import JobConfig, Override, dump_yaml, flags, job_to_dict, load_job
from ms_llm.nodes import Nodes, remove_tmp
from ms_llm.run import RunFolder
from ms_llm.run.folder import RunLock
from ms_llm.run.heartbeat import DETERMINISTIC, failed_since
from ms_llm.run.memory_tier import MemoryTier
from ms_llm.run.metrics import run_summary, whole_end
from ms_llm.strategy.plan import ModelPlan, plan


@dataclass(frozen=True)
class TrainRequest:
    config: Path
    backend: Optional[str] = None      # None: the job's own `backend`
    nproc: Optional[int] = None        # processes over all nodes; None: the strategy's world size
    run_dir: Optional[Path] = None     # None: runs/<name>-<time>
    steps: Optional[int] = None        # override train.steps
    dry_run: bool = False              # print the lowering, start nothing
    max_restarts: int = 0              # start failed workers again, resuming from the newest checkpoint
    nodes: Nodes = Nodes()             # this machine's place among several
    elastic: Optional[ElasticOptions] = None   # --elastic: the supervisor owns the job (ms_llm.elastic)
    overrides: tuple[Override, ...] = ()       # --model, --set: set in the job before it is checked


def world_size(job: JobConfig, nproc: Optional[int]) -> int:
    """Processes the strategy needs. `--nproc` fills dp = -1 (one replica without it) and must
    agree with a fixed dp."""
    s = job.strategy
    if s.dp == -1:
        return nproc if nproc is not None else s.model_parallel_size
    world = s.world_size()
    if nproc is not None and nproc != world:
        raise StrategyError(f"--nproc: {nproc} processes, but dp*tp*pp*cp = {s.dp}*{s.tp}*{s.pp}*{s.cp} = {world}; "
                            "drop --nproc or change the strategy")
    return world


def starter(backend: str) -> Callable[[JobConfig, RunFolder, int, Nodes], int]:
    """The backend's launch module: both import no framework."""
    if backend == "mindspore":
        from ms_llm.mindspore.launch import start        # msrun and its progress follower
        return start
    from torch_backend.launch import start
    return start


def spawner(backend: str):
    """The backend's launcher started and left running, for the elastic supervisor."""
    if backend == "mindspore":
        from ms_llm.mindspore.launch import spawn
        return spawn
    from torch_backend.launch import spawn
    return spawn


def absolute_paths(job: JobConfig) -> JobConfig:
    """The job's file paths as the launching shell means them (workers may start elsewhere:
    msrun starts them in the run folder), checked before any process starts."""
    t = job.train
    load, source = t.checkpoint.load, t.data.source
    if load:
        if not Path(load).exists():
            raise ConfigError(f"train.checkpoint.load: {load!r} does not exist (relative to {Path.cwd()})")
        load = str(Path(load).resolve())
    if t.data.paths:
        return with_train(job, checkpoint=dataclasses.replace(t.checkpoint, load=load), data=indexed_data(t.data))
    if source != "stdlib":
        if not Path(source).is_file():
            raise ConfigError(f"train.data.source: token file {source!r} does not exist (relative to {Path.cwd()}); "
                              "give a token file or 'stdlib'")
        source = str(Path(source).resolve())
    return with_train(job, checkpoint=dataclasses.replace(t.checkpoint, load=load),
                      data=dataclasses.replace(t.data, source=source))


def indexed_data(data: DataConfig) -> DataConfig:
    """Dataset prefixes and the tokenizer as absolute paths; each dataset opened once, so a missing
    file or an .idx that does not match its .bin stops the launch here."""
    paths = []
    for i, prefix in enumerate(data.paths):
        prefix = str(Path(prefix).resolve())
        try:
            IndexedDataset(prefix)
        except ConfigError as exc:
            raise ConfigError(f"train.data.paths[{i}]: {exc}") from None
        paths.append(prefix)
    tokenizer = data.tokenizer
    if tokenizer:
        if not Path(tokenizer).exists():
            raise ConfigError(f"train.data.tokenizer: {tokenizer!r} does not exist (relative to {Path.cwd()}); give "
                              "the tokenizer the data was prepared with, or leave it empty")
        tokenizer = str(Path(tokenizer).resolve())
    return dataclasses.replace(data, paths=tuple(paths), tokenizer=tokenizer)


def with_train(job: JobConfig, **changes) -> JobConfig:
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **changes))


def resolve(req: TrainRequest) -> tuple[JobConfig, ModelPlan]:
    """The job as the workers will read it back from config.yaml (but for the stdlib corpus,
    built once the run folder exists), and its plan. Flag and field errors come first, one line
    each; nothing is written."""
    req.nodes.check()
    if req.nodes.count > 1 and req.run_dir is None:
        raise ConfigError(f"--run-dir: required with --nnodes {req.nodes.count}: give every node the same run "
                          "folder (shared storage, or the same path on each machine)")
    job = load_job(req.config, req.overrides)
    if req.steps is not None:
        if req.steps < 0:
            raise ConfigError(f"--steps: got {req.steps}; give the number of optimizer steps, 0 or more")
        job = with_train(job, steps=req.steps)
    backend = req.backend or job.backend
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {backend!r} cannot train from this launcher; use one of {', '.join(BACKENDS)}")
    check_restarts(job, req.elastic.max_restarts if req.elastic else req.max_restarts)
    job = absolute_paths(job)
    world = world_size(job, req.nproc)
    req.nodes.local(world)
    p = plan(job.model, job.strategy, job.train, world)
    return dataclasses.replace(job, backend=backend, strategy=p.strategy), p


def with_corpus(job: JobConfig, run: RunFolder) -> JobConfig:
    """Indexed datasets get their sample order built in the run folder (workers map it) and their
    token ids checked against the vocabulary; 'stdlib' becomes the token file built there. Every
    node builds its own (its workers read it locally); on a shared folder concurrent builds write
    the same bytes under temporary names and rename them, so any of them may win."""
    if job.train.data.paths:
        for prefix in job.train.data.paths:     # prepare-data's summary records the tokenizer's vocab_size
            summary = Path(f"{prefix}.json")
            if not summary.is_file():
                continue
            try:
                vocab = json.loads(summary.read_text())["vocab_size"]
            except (ValueError, KeyError, TypeError) as exc:     # bad JSON or bytes, no key, not an object
                vocab, why = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
            else:
                why = f"vocab_size is {vocab!r}"
            if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
                raise ConfigError(f"train.data.paths: {summary} is not a prepare-data summary with an integer "
                                  f"vocab_size ({why}); write it again with `ms-llm prepare-data` or remove it")
            if vocab > job.model.vocab_size:
                raise ConfigError(f"model.vocab_size: {job.model.vocab_size}, but the tokenizer of {prefix} has "
                                  f"vocab_size {vocab} ({summary}); use vocab_size >= {vocab} or data made with "
                                  "this model's tokenizer")
        folder = samples.build(samples.DataSpec.of(job.train), run.data)
        top, prefix = samples.max_token(folder)
        if top >= job.model.vocab_size:
            raise ConfigError(f"model.vocab_size: {job.model.vocab_size}, but {prefix} holds token id {top}; use "
                              f"vocab_size >= {top + 1} (the tokenizer's) or data made with this model's tokenizer")
        return job
    if job.train.data.source != "stdlib":
        return job
    return with_train(job, data=dataclasses.replace(job.train.data, source=str(build_stdlib_corpus(run.data))))


def write_config(job: JobConfig, run: RunFolder, overrides: tuple[Override, ...] = ()) -> None:
    """<run>/config.yaml, atomically: a worker, or another node sharing the folder, reads the whole
    old file or the whole new one, never a part. A comment names the command-line overrides, whose
    values the job below already holds."""
    tmp = run.config.with_name(f".config.yaml.{socket.gethostname()}.{os.getpid()}")
    head = f"# overrides, applied below: {flags(overrides)}\n" if overrides else ""
    try:
        tmp.write_text(head + dump_yaml(job_to_dict(job)))
        os.replace(tmp, run.config)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RunFolderError(f"run folder {run.root}: cannot write config.yaml ({exc.strerror or exc})") from None


def prepare(req: TrainRequest, held: Optional[contextlib.ExitStack] = None) -> tuple[JobConfig, ModelPlan, RunFolder]:
    """Resolve, ask the backend, then (only then) create the run folder and write config.yaml.
    With `held`, the run folder's lock is taken first and kept in it: a folder another job holds
    is left untouched."""
    job, p = resolve(req)
    check(job.backend, p)
    run = RunFolder.create(job.name, req.run_dir)
    if held is not None:
        held.enter_context(RunLock(run, req.nodes.rank))
    job = with_corpus(job, run)
    write_config(job, run, req.overrides)
    return job, p, run


def dry_run(job: JobConfig, p: ModelPlan, run_dir: Optional[Path]) -> int:
    """Print the backend's lowering of the plan; neither framework is imported."""
    if job.backend == "mindspore":
        from ms_llm.mindspore.launch import dry_run as ms_dry_run
        return ms_dry_run(p, run_dir)
    from ms_llm.machine import Machine
    from torch_backend.dry_run import dry_run_text
    from torch_backend.lower import lower
    print(dry_run_text(p, lower(p, Machine.detect())))
    return 0


def release_memory_tier(job: JobConfig, run: RunFolder) -> None:
    """The run's snapshot in /dev/shm lives as long as its launch (restarts included), not an
    hour past it: the launcher frees it however the launch ends."""
    if job.train.checkpoint.memory_tier:
        MemoryTier.for_run(job.name, run.root).release()


def why_failed(run: RunFolder, since: float) -> str:
    """': <why>' for the launcher's last line: a cause a rank recorded (its heartbeat) after
    `since` that no retry fixes, else a full or read-only run folder (ranks that hit it may
    have been unable to say so), else the first error a rank recorded, else ''."""
    first = next(iter(failed_since(run.heartbeat, since).values()), None)
    cause = first.get("cause") if first else None
    if cause not in DETERMINISTIC or cause in ("disk_full", "read_only"):
        if (problem := run.disk_problem()) is not None:
            return f": {problem}"
    return f": {first.get('error', '')}" if first else ""


def train(req: TrainRequest) -> int:
    if req.dry_run:
        job, p = resolve(req)
        rc = dry_run(job, p, req.run_dir)
        print(f"dry run: nothing launched ({job.backend} backend, {p.world_size} process(es))")
        return rc
    with contextlib.ExitStack() as held:          # the run folder is this job's until it ends
        job, p, run = prepare(req, held)
        return launch(req, job, p, run)


def launch(req: TrainRequest, job: JobConfig, p: ModelPlan, run: RunFolder) -> int:
    """This node's workers started, restarted or supervised until the job ends; its last line."""
    nodes = req.nodes
    where = f", node {nodes.rank} of {nodes.count} ({nodes.local(p.world_size)} here)" if nodes.count > 1 else ""
    print(f"ms-llm train: {job.name} on {job.backend}, {p.world_size} process(es){where}, mesh {p.mesh.describe()}, "
          f"run folder {run.root}", flush=True)
    since, started = whole_end(run.metrics), time.time()     # a torn tail the workers drop is not counted
    try:
        if req.elastic is not None:
            from ms_llm.elastic.supervisor import Supervisor
            rc = Supervisor(job, load_job(req.config, req.overrides).strategy, p, run, nodes, spawner(job.backend),
                            functools.partial(write_config, overrides=req.overrides),
                            functools.partial(check, job.backend),
                            req.elastic, warm_standby=nodes.count == 1).run_job()
        else:
            start = starter(job.backend)
            rc = with_restarts(lambda: start(job, run, p.world_size, nodes), req.max_restarts, run)
    finally:
        release_memory_tier(job, run)
        remove_tmp(run, nodes)
    if rc != 0:
        print(f"ms-llm train: workers failed (exit {rc}){why_failed(run, started)}; logs in {run.logs} and "
              f"{run.launcher_log}", file=sys.stderr)
    elif nodes.rank == 0 and (done := run_summary(run.metrics, since)):
        print(f"{done}; run folder {run.root}", flush=True)
    return rc
