"""The long-sequence run context parallelism exists for, through `ms-llm train`: under one
per-rank memory limit (train.memory_limit_gb) a sequence cp1 cannot train stops with the
one-line out-of-memory error, and cp4 ring trains it. Measured for 2048 tokens of the tiny model:
cp1 runs out under 0.20 GB, cp4 trains under 0.10 GB, so 0.15 GB separates them with room on
both sides (bench/context_parallel.py --long finds cp1's edge and trains 4x it with cp4)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SEQ, LIMIT = 2048, 0.15
pytestmark = pytest.mark.slow


def train(tmp_path: Path, cp: int) -> tuple[subprocess.CompletedProcess, Path]:
    model = {**yaml.safe_load((ROOT / "configs" / "models" / "tiny.yaml").read_text()), "max_seq_len": SEQ}
    job = {"name": f"long_cp{cp}", "backend": "torch", "device": "cpu", "model": model,
           "strategy": {"cp": cp, "context_parallel": {"algorithm": "ring"},
                        "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": SEQ, "steps": 2,
                     "memory_limit_gb": LIMIT, "optimizer": {"name": "adamw", "lr": 1e-3}}}
    config, run = tmp_path / f"cp{cp}.yaml", tmp_path / f"cp{cp}"
    config.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, run


def test_cp4_trains_the_sequence_cp1_runs_out_of_memory_on(tmp_path):
    proc, _ = train(tmp_path, 1)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ms-llm train: workers failed (exit 1): OutOfMemory: rank 0 ran out of memory in step 1 "
                           f"under train.memory_limit_gb = {LIMIT} (DefaultCPUAllocator: can't allocate memory"), last
    assert "split the sequence over more ranks (strategy.cp)" in last

    proc, run = train(tmp_path, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "step" in m] == [1, 2]
