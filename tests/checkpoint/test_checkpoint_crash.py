"""Crashes: kill -9 in the middle of a background persist, restart from the memory tier."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ms_llm.checkpoint import Checkpoint, load_with_fallback
from ms_llm.checkpoint.storage.commit import latest
from ms_llm.run.memory_tier import MemoryTier, restore_folders

WORKER = Path(__file__).parents[1] / "helpers" / "ckpt_crash_worker.py"
sys.path.insert(0, str(WORKER.parent))
from ckpt_crash_worker import state  # noqa: E402


def _start(root, shm, steps):
    proc = subprocess.Popen([sys.executable, str(WORKER), str(root), str(shm), str(steps)],
                            stdout=subprocess.PIPE, text=True)
    return proc


def _wait_for(proc, marker, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == marker:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode} before {marker!r}")
    raise AssertionError(f"no {marker!r} within {timeout} s")


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


@pytest.mark.slow
def test_kill9_during_persist_leaves_previous_checkpoint(tmp_path):
    proc = _start(tmp_path, "-", 2)
    try:
        _wait_for(proc, "snapshot 2")
        time.sleep(0.3)                        # the 8 MB write of step 2 takes ~2 s
    finally:
        _kill(proc)
    assert (tmp_path / "step_00000002.tmp").is_dir()          # it was killed mid-persist
    assert latest(tmp_path).name == "step_00000001"
    ckpt = Checkpoint.open(tmp_path)
    ckpt.verify()
    assert ckpt.step == 1 and np.array_equal(ckpt.read_full("w"), state(1))


@pytest.mark.slow
def test_restart_loads_from_memory_tier_then_disk(tmp_path):
    tier = MemoryTier(Path("/dev/shm") / f"ms_llm_test_{uuid.uuid4().hex}")
    proc = _start(tmp_path, tier.root, 2)
    keeper = None
    try:
        _wait_for(proc, "memory committed")
        keeper = tier.keeper_pid()
        _kill(proc)
        # The trainer is gone; its keeper is not, and memory is a step ahead of the disk.
        os.kill(keeper, 0)
        assert latest(tmp_path).name == "step_00000001"
        folders = restore_folders(tmp_path, tier)
        assert folders[0].parent == tier.root and folders[0].name == "step_00000002"
        ckpt, w = load_with_fallback(folders, lambda c: c.read_full("w"))
        assert ckpt.step == 2 and np.array_equal(w, state(2))
        # A damaged memory copy is skipped for the newest one on disk.
        shard = folders[0] / "rank_00000.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        ckpt, w = load_with_fallback(restore_folders(tmp_path, tier), lambda c: c.read_full("w"))
        assert ckpt.step == 1 and np.array_equal(w, state(1))
        # The job ends: the keeper frees the memory and exits.
        tier.finish()
        deadline = time.monotonic() + 30
        while tier.root.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tier.root.exists()
    finally:
        if proc.poll() is None:
            _kill(proc)
        if keeper is not None:
            try:
                os.kill(keeper, signal.SIGKILL)
            except ProcessLookupError:
                pass
