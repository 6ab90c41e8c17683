"""The long-sequence run context parallelism exists for, through `ms-llm train`: under one
per-rank memory limit (train.memory_limit_gb) a sequence cp1 cannot train stops with the
one-line out-of-memory error, and cp4 ring trains it. Measured for 2048 tokens of the tiny model:
cp1 runs out under 0.20 GB, cp4 trains under 0.10 GB, so 0.15 GB separates them with room on
both sides (bench/context_parallel.py --long finds cp1's edge and trains 4x it with cp4)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEQ, LIMIT = 2048, 0.15
pytestmark = pytest.mark.slow


def bench():
    """bench/context_parallel.py, whose long_run is one `ms-llm train` of the tiny model under the limit."""
    spec = importlib.util.spec_from_file_location("context_parallel_bench", ROOT / "bench" / "context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cp4_trains_the_sequence_cp1_runs_out_of_memory_on(tmp_path):
    long_run = bench().long_run
    trained, last, _ = long_run(SEQ, 1, LIMIT, tmp_path)
    assert not trained
    assert last.startswith(f"ms-llm train: workers failed (exit 1): OutOfMemory: rank 0 ran out of memory in step 1 "
                           f"under train.memory_limit_gb = {LIMIT} (DefaultCPUAllocator: can't allocate memory"), last
    assert "split the sequence over more ranks (strategy.cp)" in last

    trained, last, metrics = long_run(SEQ, 4, LIMIT, tmp_path)
    assert trained, last
    assert metrics["step"] == 2
