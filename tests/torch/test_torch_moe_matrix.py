"""Expert parallelism trains to the single-process result (gloo, CPU, fp32, tiny_moe, dropless):
ep2, ep2 x cp2 (the experts split over the cp ranks), ep2 x dp2 with shared ZeRO-1 and ZeRO-3,
ep2 x tp2, ep2 x pp2, and expert parallel folding: ep2 x etp2 carved out of dp4 and ep4 over
dp2 x tp2 with whole experts, each with ZeRO-1 and ZeRO-3, and ep2 x etp1 over dp2 x tp2 (edp 2)
with ZeRO-2 and ZeRO-3; and torch's FSDP2 at ZeRO-2 and ZeRO-3 over ep2 x dp2, the experts sharded
over edp apart from the dense weights, and at ZeRO-2 with edp 1 (ep2 = dp2, ep2 over cp2, ep2 x tp2
with etp2, ep2 x pp2), where the experts' shard group is one rank and their gradient is divided once
(FSDP2's sum-only reduction off). Losses of 3 steps and the parameters after them (experts
gathered to full tensors), and under FSDP2 the first step's gradients, equal the world-1 run within
1e-5. The shared engine partitions the experts over their expert-data-parallel ranks (edp) at the
job's stage: what rank 0 holds of them at the end of backward is the ZeRO plan's figure, within
padding the cost model's, and 1/edp of the whole experts for what the stage shards (SGD: no optimizer
states); FSDP2 holds 1/edp of their weights and gradients at either stage. The checkpoint FSDP2's
ranks save reads back on one process as the trained weights, bit for bit. The 4-rank cases run in one
launch."""
from __future__ import annotations

import pytest
import torch

from ms_llm.checkpoint import Checkpoint
from test_torch_matrix import TOL, launcher, load, max_diff
from torch_moe_worker import CASES, SAVED, STEPS

pytestmark = pytest.mark.slow
EDP2 = ("ep2_dp2_zero1", "ep2_dp2_zero3", "ep2_dp2_tp2_etp1_zero2", "ep2_dp2_tp2_etp1_zero3", "ep2_dp2_zero2_fsdp2",
        "ep2_dp2_zero3_fsdp2")
FSDP2 = [c for c in CASES if c.endswith("_fsdp2")]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return launcher(tmp_path_factory.mktemp("moe_matrix"), "torch_moe_worker.py",
                    {c: w for c, (w, _) in CASES.items()}, 50_000)


@pytest.mark.parametrize("case", [c for c in CASES if c != "ref"])
def test_expert_parallel_equals_single_process(matrix, case):
    ref, ref_t = load(matrix(1), "ref")
    got, got_t = load(matrix(CASES[case][0]), case)
    params = {k for k in ref_t if k.startswith("param/")}
    assert params == {k for k in got_t if k.startswith("param/")}        # every parameter, once
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) <= TOL
    assert max_diff(ref_t, got_t, "param/") <= TOL
    if case in FSDP2:              # gradients stay on the parameters (the shared engine keeps them in buckets)
        assert {k for k in got_t if k.startswith("grad/")} == {k for k in ref_t if k.startswith("grad/")}
        assert max_diff(ref_t, got_t, "grad/") <= TOL
    assert ref["losses"][-1] < ref["losses"][0]
    assert got["edp"] == (2 if case in EDP2 else 1)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1].get("zero") and c not in FSDP2])
def test_the_experts_memory_per_rank_is_what_zero_over_edp_plans(matrix, case):
    got, _ = load(matrix(CASES[case][0]), case)
    held, planned = got["expert_bytes"], got["planned_expert_bytes"]
    assert {k: held[k] for k in planned} == planned
    assert sum(planned.values()) == pytest.approx(got["cost_expert_bytes"], rel=0.02)
    whole, stage, edp = got["local_expert_bytes"], CASES[case][1]["zero"]["stage"], got["edp"]
    assert held["params"] == pytest.approx(whole / (edp if stage == 3 else 1), rel=0.02)
    assert held["grads"] == pytest.approx(whole / (edp if stage >= 2 else 1), rel=0.02)
    assert held["optimizer"] == 0


@pytest.mark.parametrize("case", FSDP2)
def test_fsdp2_shards_the_experts_over_edp(matrix, case):
    got, _ = load(matrix(CASES[case][0]), case)
    whole = got["local_expert_bytes"]
    assert got["expert_bytes"] == {"params": whole // got["edp"], "grads": whole // got["edp"], "optimizer": 0}


@pytest.mark.parametrize("case", SAVED)
def test_fsdp2_expert_checkpoint_reads_back_on_one_process(matrix, case):
    """Every rank saves its edp shard of its ep slice of each expert; read whole, they are the weights."""
    out = matrix(CASES[case][0])
    _, got_t = load(out, case)
    params = {k.removeprefix("param/"): t for k, t in got_t.items() if k.startswith("param/")}
    with Checkpoint.open(out / case / f"step_{STEPS:08d}") as ckpt:
        assert ckpt.problems() == [] and set(ckpt.names()) == set(params)
        for name, t in params.items():
            assert torch.equal(torch.from_numpy(ckpt.read_full(name)), t), name
