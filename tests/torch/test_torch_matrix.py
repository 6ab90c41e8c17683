"""Correctness matrix: every strategy trains to the single-process result (gloo, CPU, fp32).

One torchrun launch per world size runs all of its strategies (tests/helpers/torch_matrix_worker.py).
For each strategy: the losses of 3 steps, the gradients of the first step and (SGD) the
parameters after the last step equal the world-1 run of the same model within 1e-5 (2 layers;
4 for the virtual-stage pipelines, a layer per chunk); the world-1 run in turn equals a
hand-written single-process loop.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import load_file

from ms_llm.data import build_stdlib_corpus
from torch_backend.launch import torchrun
from torch_matrix_worker import CASES, model_for

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
pytestmark = pytest.mark.slow


def launcher(out: Path, worker: str, worlds: dict[str, int], max_bytes: int) -> Callable[[int], Path]:
    """`results(world)`: runs `worker` once per world size under torchrun, on first use, with
    the cases of that size (`worlds`: case -> world size), and returns `out`, where the worker
    writes them."""
    tokens = build_stdlib_corpus(out / "data", max_bytes=max_bytes)
    done: set[int] = set()

    def results(world: int) -> Path:
        if world not in done:
            cases = [c for c, w in worlds.items() if w == world]
            cmd = [*torchrun(world), str(ROOT / "tests" / "helpers" / worker), str(tokens), str(out), *cases]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            done.add(world)
        return out
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("matrix"), "torch_matrix_worker.py",
                    {c: w for c, (w, _, _) in CASES.items()}, 100_000)


def load(out: Path, case: str) -> tuple[dict, dict]:
    tensors = {}
    for f in sorted(out.glob(f"{case}-rank*.safetensors")):
        tensors |= load_file(f)
    return json.loads((out / f"{case}.json").read_text()), tensors


def max_diff(a: dict, b: dict, prefix: str) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a if k.startswith(prefix))


REFERENCES = [c for c in CASES if "ref" in c.split("_")]


def reference_case(case: str) -> str:
    """The world-1 run of the same model and optimizer."""
    return next(r for r in REFERENCES if model_for(r) is model_for(case) and CASES[r][2] == CASES[case][2])


@pytest.mark.parametrize("case", REFERENCES)
def test_reference_equals_plain_loop(matrix, case):
    record, _ = load(matrix(1), case)
    assert max(abs(a - b) for a, b in zip(record["losses"], record["plain_losses"])) <= TOL
    assert record["losses"][-1] < record["losses"][0]


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFERENCES])
def test_strategy_equals_single_process(matrix, case):
    world, _, optimizer = CASES[case]
    ref, ref_t = load(matrix(1), reference_case(case))
    got, got_t = load(matrix(world), case)
    params = {k for k in ref_t if k.startswith("param/")}
    assert params == {k for k in got_t if k.startswith("param/")}        # every parameter, once
    loss_diff = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    assert loss_diff <= TOL, loss_diff
    if any(k.startswith("grad/") for k in got_t):
        assert max_diff(ref_t, got_t, "grad/") <= TOL
    if optimizer == "sgd":       # Adam scales float noise up to ~lr: parameters compared under SGD only
        assert max_diff(ref_t, got_t, "param/") <= TOL
