"""MindSpore's compile cache: one folder per job and world, shared between runs when asked.

A GRAPH-mode worker saves its start-up graphs (the parameter broadcast, the step) in MindSpore's
compile cache and loads them on a later launch, which takes the compile off it: most of a launch
on a CPU machine (a tiny dp2 job: about 27 of 38 CPU seconds). MindSpore checks only the entry
script for changes, so the folder name is ours: a hash of what the graphs are built from (the
job's config.yaml without its host-only keys, below), the world size, the MindSpore version, the
machine and every ms_llm source file. A changed model, strategy, batch, optimizer, world or code
never meets a cache compiled for another.

    <run>/compile_cache/<key>/rank_<R>/graph_cache/...     MindSpore's layout below the key

With MS_LLM_COMPILE_CACHE_DIR set (a folder of the user's, like torch's inductor cache), runs
share it too: before compiling, a worker whose run holds no graphs for its rank copies them from
<dir>/<key>/rank_<R>; after compiling, it publishes its own there. Each rank folder appears
there whole, by rename, or not at all, so concurrent runs of one job never read half a cache.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from ms_llm.nodes import ROOT
from ms_llm.run import RunFolder

RUN_ENV = "MS_LLM_COMPILE_CACHE"            # the folder the launcher hands the workers: this job, this world
SHARED_ENV = "MS_LLM_COMPILE_CACHE_DIR"     # where runs share compiled graphs; unset: each run compiles its own
# config.yaml keys no compiled graph depends on: the learning rate is a graph input, and these are
# read on the host only (names, the data, logging, checkpoints, the memory limit).
HOST_ONLY_TRAIN_KEYS = ("steps", "log_every", "schedule", "data", "checkpoint", "memory_limit_gb")


def graph_key(config_text: str, world: int) -> str:
    """16 hex digits naming the graphs a job compiles at `world` ranks with this checkout."""
    config = yaml.safe_load(config_text) or {}
    config.pop("name", None)
    for key in HOST_ONLY_TRAIN_KEYS:
        (config.get("train") or {}).pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update(f"world {world} mindspore {importlib.metadata.version('mindspore')} {platform.machine()}".encode())
    for path in sorted((ROOT / "ms_llm").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def job_cache(run: RunFolder, world: int) -> Path:
    """The compile cache folder of this run's job at `world` ranks (MindSpore adds rank_<R>/ below)."""
    return run.compile_cache / graph_key(run.config.read_text(), world)


def _shared(folder: Path, rank: int) -> Optional[Path]:
    root = os.environ.get(SHARED_ENV)
    return Path(root) / folder.name / f"rank_{rank}" if root else None


def _copy_whole(src: Path, dst: Path) -> None:
    """Copy the folder `src` to `dst` so that `dst` appears complete or not at all."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        shutil.copytree(src, staging / "copy")
        os.rename(staging / "copy", dst)
    except OSError:
        if not dst.is_dir():            # another process put it there first: theirs is as good
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(folder: Path, rank: int) -> bool:
    """Before compiling: copy this rank's graphs from the shared folder when the run has none.
    Returns whether it did."""
    shared, mine = _shared(folder, rank), folder / f"rank_{rank}"
    if shared is None or mine.exists() or not shared.is_dir():
        return False
    _copy_whole(shared, mine)
    return True


def publish(folder: Path, rank: int) -> bool:
    """After compiling: offer this rank's graphs to the shared folder, unless it has them.
    Returns whether it took them."""
    shared, mine = _shared(folder, rank), folder / f"rank_{rank}"
    if shared is None or shared.exists() or not mine.is_dir():
        return False
    _copy_whole(mine, shared)
    return True
