"""Test-wide settings: this checkout first on every path, temporary files inside it.

Tests live in one folder per area (strategy, torch, mindspore, checkpoint, convert, data,
elastic, run, cli); the worker, probe and shared-case scripts they start or import live in
tests/helpers, which is importable from every test and from the workers themselves."""
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path[:0] = [str(ROOT), str(HELPERS)]
# Subprocesses (torchrun / msrun workers) import this checkout too, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("TMPDIR", str(ROOT / ".tmp"))
# One OpenMP thread per process, as torchrun sets for several processes per node: the suite runs
# four pytest workers and their launches on a few cores, where idle OpenMP threads only spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")
(ROOT / ".tmp").mkdir(exist_ok=True)

# The files that start several processes, longest first (`pytest --durations`): handed out in this
# order, they keep the workers of `make test` (pytest-xdist, one file to a worker at a time) busy
# until the end instead of leaving one long file to run alone.
LONGEST_FIRST = (
    "checkpoint/test_checkpoint_resume.py", "elastic/test_elastic_faults.py", "mindspore/test_ms_deepseek_train.py",
    "torch/test_torch_matrix.py", "mindspore/test_ms_worker.py", "elastic/test_multinode.py",
    "mindspore/test_ms_deepseek.py", "torch/test_torch_moe_matrix.py", "torch/test_torch_fp16.py",
    "torch/test_torch_deepseek_matrix.py", "mindspore/test_ms_compile_cache.py", "cli/test_readme.py",
    "checkpoint/test_import_deepspeed.py", "mindspore/test_ms_train.py", "checkpoint/test_import_megatron.py",
    "data/test_data_train.py", "torch/test_zero_torch.py", "mindspore/test_import_mindformers.py",
    "cli/test_fuzz.py", "cli/test_bench.py", "mindspore/test_ms_weight_decay.py",
    "mindspore/test_zero_mindspore.py", "torch/test_torch_cp_long.py", "checkpoint/test_import_torchtitan.py",
    "mindspore/test_ms_model.py", "convert/test_convert_peers.py", "cli/test_boundary.py",
    "checkpoint/test_import_run.py",
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


# MS_LLM_TEST_CPU_LOG=<file>: one JSON line per test with the CPU seconds it used, its own and its
# finished subprocesses' (torchrun / msrun and their workers), and its wall seconds. The suite is
# CPU-bound on small machines, so this (not wall time under -n) says which tests cost the most.
CPU_LOG = os.environ.get("MS_LLM_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    with open(CPU_LOG, "a") as log:
        log.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2),
                              "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
