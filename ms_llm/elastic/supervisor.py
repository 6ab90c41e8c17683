"""The elastic supervisor: one per node, it owns the job (`ms-llm train ... --elastic`).

    launch -> watch -> failure? -> stop every process, sure they are gone -> classify
           -> deterministic: stop with a report naming the cause
           -> transient: decide the world (same, shrink dp, grow dp) -> relaunch, resuming
              from the newest checkpoint (memory tier first, then disk), resharded

It starts the backend's launcher (torchrun, msrun) in a session of its own, watches the
workers' exits and heartbeats (ms_llm.elastic.watch), and on a failure kills, by PID, the
launcher and every process below it. Nothing outlives a supervisor killed outright: the
launcher gets SIGKILL from the kernel (PR_SET_PDEATHSIG) and every worker exits from a thread
that waits on the supervisor's pidfd (ms_llm.nodes.exit_with_supervisor).

The world follows the ranks this node can use: the launch's size, or the number an operator
or a health checker writes to <run>/elastic/capacity.node<R> (fewer: shrink at the next
failure; more: grow at the next committed checkpoint); ms_llm.elastic.world keeps tp/pp/cp
where it can and asks the strategy search where it cannot. On several nodes the survivors
agree on the nodes left (ms_llm.elastic.members) and shrink to them. On one node a standby
launch (torchrun or msrun) waits with its workers' imports done at a gate: a relaunch of the
same size opens it, which saves the launcher's start and the imports (most of a torch
recovery; with the compile cache, a third of a MindSpore one). Recovery time (failure
detected -> every rank's first new step) is printed and appended to metrics.jsonl with the
cause and the new world.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ms_llm.checkpoint.storage.commit import latest
from ms_llm.elastic.classify import Failure, deterministic
from ms_llm.elastic.members import Membership
from ms_llm.elastic.watch import LaunchWatch, Timeouts
from ms_llm.elastic.world import BackendCheck, changes, choose_world
from ms_llm.job import JobConfig
from ms_llm.nodes import COLLECTIVE_TIMEOUT_ENV, GATE_ENV, Nodes
from ms_llm.processes import SUPERVISOR_ENV, descendants, kill_all
from ms_llm.run import RunFolder
from ms_llm.run.metrics import append_record
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import ModelPlan

Spawn = Callable[..., subprocess.Popen]       # (job, run, world, nodes, env=None): the backend's launch.spawn


@dataclass
class Standby:
    """A launch started ahead of a failure: its workers have imported everything and wait at a
    gate file (ms_llm.nodes.wait_for_gate), so a relaunch of the same size skips process start
    and imports."""
    proc: subprocess.Popen
    world: int
    gate: Path


@dataclass(frozen=True)
class ElasticOptions:
    max_restarts: int = 3                # relaunches after failures (growing is not one)
    min_ranks: Optional[int] = None      # the smallest world to shrink to; None: 1
    timeouts: Timeouts = Timeouts()
    poll_s: float = 0.1


@dataclass
class Supervisor:
    job: JobConfig                       # resolved for the first world
    strategy: ParallelStrategy           # the job's strategy as written (dp may be fixed or -1)
    plan: ModelPlan
    run: RunFolder
    nodes: Nodes
    spawn: Spawn
    write_config: Callable[[JobConfig, RunFolder], None]
    backend_check: BackendCheck          # does the job's backend run a new world's plan
    options: ElasticOptions = ElasticOptions()
    warm_standby: bool = False           # keep a gated launch ready (one node: its own rendezvous)
    failures: list[Failure] = field(default_factory=list)
    standby: Optional[Standby] = None
    launches: int = 0
    members: Optional[Membership] = None  # several nodes: who is still there
    active: Optional[subprocess.Popen] = None

    def __post_init__(self) -> None:
        self.first_nodes = self.nodes
        self.per_node = self.nodes.local(self.plan.world_size)       # ranks this node runs at the start
        if self.nodes.count > 1:
            self.members = Membership(self.run.root / "elastic", self.nodes.rank, self.nodes.master_addr)
            self.members.beat(force=True)

    def log(self, text: str) -> None:
        print(f"ms-llm elastic: {text}", file=sys.stderr, flush=True)

    def record(self, **fields) -> None:
        """One line in metrics.jsonl, appended whole (rank 0 appends to the same file)."""
        try:
            append_record(self.run.metrics, {"time": time.time(), **fields})
        except OSError as exc:                 # a full disk: the console has it already
            self.log(f"could not append to {self.run.metrics} ({exc.strerror or exc})")

    def capacity(self) -> int:
        """Ranks usable over the nodes still there: this node's capacity file (an operator or a
        health checker writes it), else the ranks it ran at the start, on every node."""
        path = self.run.root / "elastic" / f"capacity.node{self.first_nodes.rank}"
        try:
            return int(path.read_text().strip()) * self.nodes.count
        except (OSError, ValueError):
            return self.per_node * self.nodes.count

    def run_job(self) -> int:
        os.environ.setdefault(COLLECTIVE_TIMEOUT_ENV, str(int(max(60.0, 2 * self.options.timeouts.hang(None)))))
        os.environ[SUPERVISOR_ENV] = str(os.getpid())   # every worker exits when this process is gone
        def stop(signum, frame):               # SIGTERM: leave no worker behind (the finally below)
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, stop)
        try:
            return self._supervise()
        finally:                               # also on Ctrl-C: the launches are in sessions of their own
            if self.active is not None and self.active.poll() is None:
                self._stop(self.active)
            self._discard_standby()
            signal.signal(signal.SIGTERM, previous)

    def _launch(self, world: int) -> subprocess.Popen:
        """The standby when it has this size (opening its gate starts it), else a fresh launch."""
        self.launches += 1
        standby, self.standby = self.standby, None
        if standby is not None and standby.world == world and standby.proc.poll() is None:
            standby.gate.touch()
            return standby.proc
        if standby is not None:
            self._stop(standby.proc)
        return self.spawn(self.job, self.run, world, self.nodes)

    def _prepare_standby(self, world: int) -> None:
        folder = self.run.root / "elastic"
        folder.mkdir(exist_ok=True)
        gate = folder / f"gate.node{self.nodes.rank}.{self.launches + 1}"
        gate.unlink(missing_ok=True)
        proc = self.spawn(self.job, self.run, world, self.nodes, env={GATE_ENV: str(gate)})
        self.standby = Standby(proc, world, gate)

    def _discard_standby(self) -> None:
        if self.standby is not None:
            self._stop(self.standby.proc)
            self.standby = None
        for gate in (self.run.root / "elastic").glob(f"gate.node{self.nodes.rank}.*"):
            gate.unlink(missing_ok=True)

    def _supervise(self) -> int:
        p, restarts, recovering = self.plan, 0, None
        min_ranks = self.options.min_ranks or 1
        while True:
            world = p.world_size
            local = self.nodes.local(world)
            watch = LaunchWatch(self.run.heartbeat, range(self.nodes.rank * local, (self.nodes.rank + 1) * local),
                                time.time(), self.options.timeouts)
            base = self._newest_step()
            proc = self.active = self._launch(world)
            outcome, grow = self._watch(proc, watch, recovering, base)
            recovering = None
            if outcome is None and not grow:
                return 0
            at = time.monotonic()
            left = self._stop(proc)
            if left:
                self.log(f"processes {left} survived SIGKILL; stopping here")
                return self._report(f"could not stop processes {left}", 1)
            if grow:
                q, _ = choose_world(self.job, self.strategy, self.capacity(), min_ranks, self.backend_check,
                                    self.nodes.count)
                self.log(f"capacity returned: growing from {world} to {q.world_size} ranks at checkpoint "
                         f"step {self._newest_step()}")
                p = self._switch(q, world, "grow")
                recovering = (at, "grow")
                continue
            self.failures.append(outcome)
            self.log(f"failure ({outcome.kind}): {outcome.detail}")
            self.record(event="failure", kind=outcome.kind, ranks=list(outcome.ranks), step=outcome.step,
                        detail=outcome.detail, world=world)
            why = deterministic(outcome, self.failures[:-1], world) or self.run.disk_problem()
            if why is not None:
                return self._report(f"not retried: {why}", 1)
            if restarts >= self.options.max_restarts:
                return self._report(f"{len(self.failures)} failure(s), more than --max-restarts "
                                    f"{self.options.max_restarts}; the last: {outcome.detail}", 1)
            restarts += 1
            if self.members is not None:
                nodes = self.members.survivors(self.first_nodes, restarts)
                if nodes.count != self.nodes.count:
                    self.log(f"{self.nodes.count - nodes.count} node(s) gone: {nodes.count} left, this one is "
                             f"node {nodes.rank}")
                self.nodes = nodes
            q, reasons = choose_world(self.job, self.strategy, min(self.capacity(), world), min_ranks,
                                      self.backend_check, self.nodes.count)
            if q is None:
                return self._report("no world fits the ranks left: " + "; ".join(reasons), 1)
            self.log(f"restart {restarts} of {self.options.max_restarts}: {q.world_size} ranks (was {world}), "
                     f"resuming from the newest checkpoint in {self.run.checkpoints}")
            p = self._switch(q, world, "shrink" if q.world_size < world else "same")
            recovering = (at, outcome.kind)

    def _watch(self, proc: subprocess.Popen, watch: LaunchWatch, recovering, base: int) -> tuple[Optional[Failure], bool]:
        """Until the launch ends or fails: (failure or None, whether to grow)."""
        world = len(watch.ranks) * self.nodes.count
        while True:
            rc = proc.poll()
            failure = watch.poll()
            if recovering is not None and watch.first_new_step(base):
                seconds = time.monotonic() - recovering[0]
                self.log(f"recovered in {seconds:.1f} s (failure detected -> every rank's first new step)")
                self.record(event="recovered", recovery_s=round(seconds, 3), cause=recovering[1], world=world)
                recovering = None
            if self.warm_standby and self.standby is None and rc is None and watch.first_new_step(base):
                self._prepare_standby(world)         # after the first step: its imports do not slow startup
            if failure is not None and failure.kind == "exit":
                failure = self._settle(watch, failure)
            if failure is not None:
                return failure, False
            if rc is not None:
                if rc == 0 and watch.all_done():
                    return None, False
                watch.poll()
                return Failure("launcher", (), min((b["step"] for b in watch.beats.values()), default=0),
                               f"the launcher exited with {rc} before every rank finished"), False
            if self.capacity() > world and self._newest_step() > base:
                return None, True
            if self.members is not None:
                self.members.beat()
            time.sleep(self.options.poll_s)

    def _settle(self, watch: LaunchWatch, first: Failure, grace_s: float = 1.0) -> Failure:
        """Give the other ranks a moment to report theirs: 'the same error on every rank' needs them."""
        deadline, failure = time.monotonic() + grace_s, first
        while time.monotonic() < deadline and len(failure.errors) < len(watch.ranks):
            time.sleep(0.05)
            failure = watch.poll() or failure
        return failure

    def _stop(self, proc: subprocess.Popen) -> list[int]:
        """SIGKILL the launcher and every process below it (workers have sessions of their own),
        by PID, the tree read first; wait until all are gone. Returns the survivors."""
        with contextlib.suppress(ProcessLookupError):       # already gone: only its tree is left to stop
            os.kill(proc.pid, signal.SIGSTOP)                  # SIGSTOP: the launcher cannot start anything new meanwhile
        left = kill_all([proc.pid, *descendants(proc.pid)])
        proc.wait()
        if getattr(proc, "echo", None) is not None:
            proc.echo.join(timeout=5)
        return left

    def _switch(self, q: ModelPlan, old_world: int, why: str) -> ModelPlan:
        """Rewrite config.yaml when the plan changed (the workers read it from there); say what changed."""
        changed = changes(self.job, q)
        if changed:
            self.job = dataclasses.replace(self.job, strategy=q.strategy, train=q.train)
            self.write_config(self.job, self.run)
            self.log(f"{why}: {old_world} -> {q.world_size} ranks, {changed}; {q.micro_batches} micro-batch(es) per "
                     f"replica, global batch {q.train.global_batch_size}")
            self.record(event="world", world=q.world_size, dp=q.strategy.dp, micro_batches=q.micro_batches,
                        reason=why, changed=changed)
        return q

    def _newest_step(self) -> int:
        folder = latest(self.run.checkpoints)
        return int(folder.name.split("_")[1]) if folder is not None else 0

    def _report(self, cause: str, rc: int) -> int:
        """Stop: the cause, every failure, the checkpoints left, in the log and <run>/elastic/report.json."""
        kept = sorted(p.name for p in self.run.checkpoints.glob("step_*") if (p / "index.json").is_file())
        report = {"cause": cause, "failures": [dataclasses.asdict(f) for f in self.failures],
                  "checkpoints": kept, "latest": self._newest_step()}
        path = self.run.root / "elastic" / f"report.node{self.nodes.rank}.json"
        self.log(f"stopped: {cause}")
        self.log(f"checkpoints kept: {', '.join(kept) or 'none'} (latest: step {report['latest']}); report in "
                 f"{path}")
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
        except OSError as exc:                 # a full disk: the console has it
            self.log(f"could not write {path} ({exc.strerror or exc})")
        self.record(event="stopped", cause=cause)
        return rc
