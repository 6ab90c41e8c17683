"""Remove what a run leaves outside its results: its memory-tier snapshot in /dev/shm (the
keeper is told to stop, or the folder removed when none runs) and checkpoint folders a crash
left half-written. Checkpoints, logs and metrics stay. A run folder a job still holds (its
.lock.node<R>) is refused: its half-written checkpoint is the one being saved.

examples:
  ms-llm clean runs/tiny
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
from pathlib import Path

import yaml

from ms_llm.errors import ConfigError
from ms_llm.run.folder import RunFolder, RunLock
from ms_llm.run.memory_tier import MemoryTier


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds config.yaml)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"clean: {run_dir / 'config.yaml'}: cannot read it ({exc}); is {run_dir} a run folder?")
    if not isinstance(config, dict) or not isinstance(config.get("name"), str):
        raise ConfigError(f"clean: {run_dir / 'config.yaml'}: no job name; is {run_dir} a run folder?")
    with contextlib.ExitStack() as held:                  # every node's lock: no job is running there
        for lock in sorted(run_dir.glob(".lock.node*")):
            held.enter_context(RunLock(RunFolder(run_dir), int(lock.name.removeprefix(".lock.node"))))
        return _clean(run_dir, config["name"])


def _clean(run_dir: Path, name: str) -> int:
    tier = MemoryTier.for_run(name, run_dir)
    removed = [str(tier.root)] if tier.release() else []
    checkpoints = run_dir / "checkpoints"
    for partial in sorted(checkpoints.glob("step_*.tmp")) + sorted(checkpoints.glob("step_*.old")):
        shutil.rmtree(partial)
        removed.append(str(partial))
    print("ms-llm clean: removed " + ", ".join(removed) if removed else f"ms-llm clean: {run_dir} left nothing behind")
    return 0
