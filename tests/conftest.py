"""Test-wide settings: this checkout first on every path, temporary files inside it.

Tests live in one folder per area (strategy, torch, mindspore, checkpoint, convert, data,
elastic, run, cli); the worker, probe and shared-case scripts they start or import live in
tests/helpers, which is importable from every test and from the workers themselves."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path[:0] = [str(ROOT), str(HELPERS)]
# Subprocesses (torchrun / msrun workers) import this checkout too, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("TMPDIR", str(ROOT / ".tmp"))
(ROOT / ".tmp").mkdir(exist_ok=True)

# The files that start several processes, longest first (`pytest --durations`): handed out in this
# order, they keep the workers of `make test` (pytest-xdist, one file to a worker at a time) busy
# until the end instead of leaving one long file to run alone.
LONGEST_FIRST = (
    "checkpoint/test_checkpoint_resume.py", "elastic/test_elastic_faults.py", "mindspore/test_zero_mindspore.py",
    "torch/test_torch_matrix.py", "mindspore/test_ms_worker.py", "elastic/test_multinode.py",
    "mindspore/test_ms_deepseek.py", "mindspore/test_ms_deepseek_train.py", "mindspore/test_ms_moe.py",
    "mindspore/test_ms_compile_cache.py", "torch/test_torch_deepseek_matrix.py",
    "torch/test_torch_fp16.py", "mindspore/test_ms_train.py", "cli/test_readme.py", "torch/test_torch_moe_matrix.py",
    "torch/test_zero_torch.py", "convert/test_convert_peers.py", "data/test_data_train.py", "cli/test_boundary.py",
    "cli/test_fuzz.py", "torch/test_torch_cp_long.py",
)


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """MindSpore runs of one job share their compiled graphs across the suite (each compile is
    most of a launch on CPU): one folder for every pytest-xdist worker of this session."""
    from ms_llm.mindspore.compile_cache import SHARED_ENV

    base = tmp_path_factory.getbasetemp()
    os.environ[SHARED_ENV] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ms-compile-cache")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(ROOT / "tests").as_posix(), len(rank)))
