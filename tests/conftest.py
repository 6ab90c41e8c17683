"""Test-wide settings: this checkout first on every path, temporary files inside it.

Tests live in one folder per area (strategy, torch, mindspore, checkpoint, convert, data,
elastic, run, cli); the worker, probe and shared-case scripts they start or import live in
tests/helpers, which is importable from every test and from the workers themselves."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path[:0] = [str(ROOT), str(HELPERS)]
# Subprocesses (torchrun / msrun workers) import this checkout too, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("TMPDIR", str(ROOT / ".tmp"))
(ROOT / ".tmp").mkdir(exist_ok=True)
