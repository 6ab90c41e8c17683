"""MoE checkpoints reshard like any other tensor: experts saved split over ep (and tp) load under
another ep, under data parallel only, or on one rank, bit for bit, with their Adam moments."""
import numpy as np
import pytest

from ckpt_helpers import cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, run_config
from ms_llm.config.model import ModelConfig, MoEConfig

# Layer 0 dense (first_dense_layers), layer 1 MoE with 4 routed experts and a shared expert.
MOE = ModelConfig(name="ckpt_moe", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_hidden_size=48, max_seq_len=32, dtype="float32",
                  moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, shared_experts=1,
                                first_dense_layers=1))

PAIRS = {
    "ep4-to-ep2": (({"dp": 4, "ep": 4}, 4), ({"dp": 2, "ep": 2}, 2)),
    "ep2-to-dp2": (({"dp": 2, "ep": 2, "zero": {"stage": 1}}, 2), ({"dp": 2, "zero": {"stage": 3}}, 2)),
    "ep2_tp2-to-single": (({"dp": 2, "ep": 2, "tp": 2}, 4), ({"dp": 1}, 1)),
    "single-to-ep2_pp2": (({"dp": 1}, 1), ({"dp": 2, "ep": 2, "pp": 2}, 4)),
    # expert moments sharded over edp (ZeRO-1 over the ranks holding the same experts) and back
    "ep2_edp2_zero1-to-ep4": (({"dp": 4, "ep": 2, "zero": {"stage": 1}}, 4), ({"dp": 4, "ep": 4}, 4)),
    "ep4-to-ep2_edp2_zero3": (({"dp": 4, "ep": 4}, 4), ({"dp": 4, "ep": 2, "zero": {"stage": 3}}, 4)),
    # expert parallel folding: ep over dp x tp with whole experts, to the width split over etp carved from dp
    "ep4_etp1_dp2_tp2_zero1-to-ep2_etp2": (({"dp": 2, "tp": 2, "ep": 4, "etp": 1, "zero": {"stage": 1}}, 4),
                                          ({"dp": 4, "ep": 2, "etp": 2}, 4)),
}


def save(root, ref, strategy, world):
    plan = plan_for(strategy, world, MOE)
    for rank in reversed(range(world)):
        w = CheckpointWriter(root, rank, world)
        items = [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(plan, rank).items() if p.primary]
        w.save(3, items, state={"step": 3}, config=run_config(plan, "torch"))
        w.close()


def test_expert_weights_are_named_split_over_ep():
    plan = plan_for({"dp": 4, "ep": 2, "tp": 2}, 8, MOE)
    w = plan.params["model.layers.1.mlp.experts.down_proj.weight"]
    assert w.layout.axes_of(0) == ("ep",) and w.layout.axes_of(2) == ("etp",)     # etp = tp by default
    assert w.layout.local_shape() == (2, 32, 8)
    assert "model.layers.0.mlp.gate_proj.weight" in plan.params         # the leading dense layer
    assert plan.params["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (16, 32)
    assert w.optimizer_layout == w.layout                                # zero.stage 0: moments whole


def test_expert_moments_are_sharded_over_edp_under_zero():
    """ZeRO-1 over edp whatever the stage: moments split over the edp ranks, weights and
    gradients whole on each (the backend's expert path updates them beside the shared partition)."""
    plan = plan_for({"dp": 4, "ep": 2, "tp": 2, "zero": {"stage": 3}}, 8, MOE)
    w = plan.params["model.layers.1.mlp.experts.down_proj.weight"]
    assert w.optimizer_layout.axes_of(0) == ("ep", "edp") and w.optimizer_layout.local_shape() == (1, 32, 8)
    assert w.stored_layout == w.grad_layout == w.layout


@pytest.mark.parametrize("name", list(PAIRS))
def test_experts_reshard(tmp_path, name):
    (src, src_world), (dst, dst_world) = PAIRS[name]
    ref = reference(MOE)
    save(tmp_path / "ckpt", ref, src, src_world)
    ckpt = Checkpoint.open(tmp_path / "ckpt")
    target = plan_for(dst, dst_world, MOE)
    covered = {n: np.zeros(a.shape, dtype=bool) for n, a in ref.items()}
    for rank in range(dst_world):
        for n, p in rank_pieces(target, rank).items():
            got = ckpt.read(n, p.region)
            assert np.array_equal(got, cut(ref[n], p.region)), (n, rank)
            covered[n][tuple(slice(o, o + s) for o, s in zip(p.region.offsets, p.region.sizes))] = True
    assert all(c.all() for c in covered.values())
    ckpt.close()
