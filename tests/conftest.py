"""Test-wide settings: this checkout first on every path, temporary files inside it."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Subprocesses (torchrun / msrun workers) import this checkout too, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("TMPDIR", str(ROOT / ".tmp"))
(ROOT / ".tmp").mkdir(exist_ok=True)
