"""Watching one launch: worker exits, dead PIDs and heartbeats that stop advancing.

    watch = LaunchWatch(run.heartbeat, ranks, launched_at, timeouts)
    failure = watch.poll()          # None while every rank makes progress

A rank is hung when its heartbeat has not changed for `timeouts.hang(step_time)` seconds:
the override when given, else `factor` times the median step time measured from the beats
so far, never below `floor_s`. Until a rank's first step (imports, rendezvous, compile,
checkpoint load) the startup timeout applies instead. A stopped process (SIGSTOP) writes no
beat and is caught the same way; so are the survivors of a dead peer blocked in a collective.
A hang names the rank that holds the others up (a stopped process, else the rank a step behind),
not only the peers waiting for it, whose heartbeats stop too.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ms_llm.elastic.classify import Failure
from ms_llm.processes import alive, stopped
from ms_llm.run.heartbeat import read_heartbeats


@dataclass(frozen=True)
class Timeouts:
    hang_s: Optional[float] = None       # --hang-timeout: a fixed timeout, None: derived from step times
    floor_s: float = 30.0                # the derived timeout never goes below this
    factor: float = 10.0                 # derived timeout = factor x median step time
    startup_s: float = 600.0             # before a rank's first step

    def hang(self, step_s: Optional[float]) -> float:
        if self.hang_s is not None:
            return self.hang_s
        return max(self.floor_s, self.factor * step_s) if step_s else self.floor_s


@dataclass
class LaunchWatch:
    folder: Path                         # <run>/heartbeat
    ranks: range                         # the global ranks this node runs
    launched_at: float                   # wall clock (heartbeat records carry wall-clock times)
    timeouts: Timeouts
    beats: dict[int, dict] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    def current(self) -> dict[int, dict]:
        """This launch's records of this node's ranks (older files are from a previous launch)."""
        fresh = {r: b for r, b in read_heartbeats(self.folder).items()
                 if r in self.ranks and b.get("time", 0) >= self.launched_at}
        first = self.beats.get(min(self.ranks)) if self.ranks else None
        new = fresh.get(min(self.ranks)) if self.ranks else None
        if first and new and first["phase"] == new["phase"] == "train" and new["step"] > first["step"]:
            per_step = (new["time"] - first["time"]) / (new["step"] - first["step"])
            self.step_times = (self.step_times + [per_step])[-50:]
        self.beats.update(fresh)
        return self.beats

    def step_time(self) -> Optional[float]:
        return statistics.median(self.step_times) if self.step_times else None

    def poll(self) -> Optional[Failure]:
        beats = self.current()
        done = min((b["step"] for b in beats.values()), default=0)
        # A rank gone without a word is the cause; its peers' errors (a reset connection) follow from it.
        dead = [r for r, b in beats.items() if b["phase"] not in ("done", "failed") and not alive(int(b["pid"]))]
        if dead:
            return Failure("died", tuple(sorted(dead)), done, ", ".join(
                f"rank {r} (pid {beats[r]['pid']}) died at step {beats[r]['step']}" for r in sorted(dead)))
        failed = {r: (b.get("cause", "error"), b.get("error", "")) for r, b in beats.items() if b["phase"] == "failed"}
        if failed:
            return Failure("exit", tuple(sorted(failed)), done, "; ".join(f"rank {r}: {e}" for r, (_, e) in
                                                                           sorted(failed.items())), failed)
        now = time.time()
        limit = self.timeouts.hang(self.step_time())
        late, stale = [], []
        for r in self.ranks:
            b = beats.get(r)
            if b is None:
                if now - self.launched_at > self.timeouts.startup_s:
                    late.append(f"rank {r} never started ({self.timeouts.startup_s:.0f} s)")
            elif b["phase"] in ("resume", "start"):
                if now - b["time"] > self.timeouts.startup_s:
                    late.append(f"rank {r} did not reach its first step in {self.timeouts.startup_s:.0f} s")
            elif b["phase"] == "train" and now - b["time"] > limit:
                stale.append(r)
        if not late and not stale:
            return None
        culprits = self.culprits(beats) if stale else ()
        lines = [self._stopped_line(r, beats[r], now) for r in culprits]
        for r in stale:
            if r not in culprits:
                waits = f", waiting for rank {', '.join(map(str, culprits))}" if culprits else ""
                lines.append(f"rank {r} made no progress after step {beats[r]['step']} for "
                             f"{now - beats[r]['time']:.1f} s (timeout {limit:.1f} s){waits}")
        return Failure("hang", culprits, done, "; ".join(late + lines))

    def culprits(self, beats: dict[int, dict]) -> tuple[int, ...]:
        """The ranks whose heartbeat stopped, not the peers that wait for them in a collective (whose
        heartbeats stop too, and may pass the timeout first): the stopped processes, else the ranks a
        step behind the others; none when the heartbeats cannot tell."""
        training = {r: beats[r] for r in self.ranks if beats.get(r, {}).get("phase") == "train"}
        halted = tuple(r for r, b in training.items() if stopped(int(b["pid"])))
        if halted:
            return halted
        low = min((b["step"] for b in training.values()), default=0)
        behind = tuple(r for r, b in training.items() if b["step"] == low)
        return behind if len(behind) < len(training) else ()

    @staticmethod
    def _stopped_line(rank: int, beat: dict, now: float) -> str:
        how = " (the process is stopped)" if stopped(int(beat["pid"])) else ""
        return (f"rank {rank}'s heartbeat stopped after step {beat['step']}, {now - beat['time']:.1f} s ago{how}: "
                f"it holds the others up")

    def all_done(self) -> bool:
        return all(self.beats.get(r, {}).get("phase") == "done" for r in self.ranks)

    def first_new_step(self, resumed_at: int) -> bool:
        """Every rank of this node has completed a step in this launch, which resumed from step
        `resumed_at` or before: it reports steps, or it failed after one (a rank whose peer died
        a few steps in may already say "failed" when the supervisor next looks)."""
        beats = [self.beats.get(r, {}) for r in self.ranks]
        return all(b.get("phase") in ("train", "done") or (b.get("phase") == "failed" and b["step"] > resumed_at)
                   for b in beats)
