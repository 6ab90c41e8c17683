"""Restarting failed workers, the same for both backends.

`--elastic` runs the supervisor (supervisor.py: watch.py detects, classify.py decides whether
to retry, world.py re-plans dp, members.py tracks the nodes; ms_llm/processes.py stops
processes). Without it, `--max-restarts N` is the plain relaunch below:

A launch that fails is started again (a fresh rendezvous, the same run folder), a bounded
number of times. Workers resume from the run folder's newest checkpoint that every rank can
load (ms_llm.run.checkpoints), or from the memory tier when it is newer, so a crash costs
the steps since that checkpoint, not the run.
"""
from __future__ import annotations

import sys
from typing import Callable

from ms_llm.errors import ConfigError
from ms_llm.job import JobConfig
from ms_llm.run import RunFolder


def with_restarts(start: Callable[[], int], max_restarts: int, run: RunFolder) -> int:
    """Run `start` (one launch of every worker, returning its exit status), and again after
    each failure, at most `max_restarts` more times; not after a failure a restart would repeat
    (a full or read-only run folder), which the launcher's last line then names."""
    rc = start()
    for attempt in range(1, max_restarts + 1):
        if rc == 0 or run.disk_problem() is not None:
            break
        print(f"ms-llm train: workers failed (exit {rc}); restart {attempt} of {max_restarts}, resuming from "
              f"the newest checkpoint in {run.checkpoints}", file=sys.stderr, flush=True)
        rc = start()
    return rc


def check_restarts(job: JobConfig, max_restarts: int) -> None:
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts: got {max_restarts}; use 0 (fail on the first error) or more")
    if max_restarts and job.train.checkpoint.interval == 0:
        raise ConfigError("--max-restarts: train.checkpoint.interval is 0, so a restart would begin again at "
                          "step 0; set train.checkpoint.interval to a step count or 'auto'")
