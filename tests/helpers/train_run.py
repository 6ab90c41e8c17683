"""`ms-llm train` as a user runs it, in a subprocess from the checkout, for the tests that continue
a run and compare its loss curve."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def train_losses(config: Path, run: Path, backend: str, *flags: str, timeout_s: float = 600) -> dict[int, float]:
    """{step: loss} of `ms-llm train CONFIG --run-dir RUN --backend BACKEND FLAGS...`; the test fails
    with the output's tail when it exits non-zero."""
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                           "--backend", backend, *flags], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
