"""Expert parallelism trains to the single-process result (gloo, CPU, fp32, tiny_moe, dropless):
ep2, ep2 x cp2 (the experts split over the cp ranks), ep2 x dp2 with shared ZeRO-1 and ZeRO-3,
ep2 x tp2, ep2 x pp2, and expert parallel folding: ep2 x etp2 carved out of dp4 and ep4 over
dp2 x tp2 with whole experts, each with ZeRO-1 and ZeRO-3, and ep2 x etp1 over dp2 x tp2 (edp 2)
with ZeRO-1. Losses of 3 steps and the parameters after them (experts gathered to full tensors)
equal the world-1 run within 1e-5; under ZeRO the experts' optimizer states are sharded over
their expert-data-parallel ranks. The 4-rank cases run in one launch."""
from __future__ import annotations

import pytest

from test_torch_matrix import TOL, launcher, load, max_diff
from torch_moe_worker import CASES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("moe_matrix"), "torch_moe_worker.py",
                    {c: w for c, (w, _) in CASES.items()}, 50_000)


@pytest.mark.parametrize("case", [c for c in CASES if c != "ref"])
def test_expert_parallel_equals_single_process(matrix, case):
    ref, ref_t = load(matrix(1), "ref")
    got, got_t = load(matrix(CASES[case][0]), case)
    assert set(ref_t) == set(got_t)                      # every parameter, once
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) <= TOL
    assert max_diff(ref_t, got_t, "param/") <= TOL
    assert ref["losses"][-1] < ref["losses"][0]
    # under ZeRO each rank's expert optimizer holds 1/edp of its experts' states (ep2 x dp2: edp 2)
    zero = CASES[case][1].get("zero", {}).get("stage", 0)
    assert got["expert_state"] == (1 / got["edp"] if zero else 1)
    assert got["edp"] == (2 if case in ("ep2_dp2_zero1", "ep2_dp2_zero3", "ep2_dp2_tp2_etp1_zero1") else 1)
