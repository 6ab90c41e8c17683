"""MoE checkpoints reshard like any other tensor: experts saved split over ep (and tp) load under
another ep, under data parallel only, or on one rank, bit for bit, with their Adam moments. Under ZeRO
the experts are sharded over edp, and the pieces a checkpoint writes are the shared engine's."""
import numpy as np
import pytest

from ckpt_helpers import STATES, cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, Region, SaveItem, optim_name, optim_pieces, run_config
from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.mindspore.lower import stage_param_entries
from ms_llm.zero import zero_plan

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


def test_experts_are_sharded_over_edp_at_the_jobs_zero_stage():
    """ZeRO over edp (the ranks holding the same expert shard: dp4 x tp2 with ep2 leaves 2): moments
    from stage 1, gradients from stage 2, weights at stage 3, on the expert dim after ep."""
    for stage in (1, 2, 3):
        plan = plan_for({"dp": 4, "ep": 2, "tp": 2, "zero": {"stage": stage}}, 8, MOE)
        w = plan.params["model.layers.1.mlp.experts.down_proj.weight"]
        assert w.optimizer_layout.axes_of(0) == ("ep", "edp") and w.optimizer_layout.local_shape() == (1, 32, 8)
        assert w.grad_layout == (w.optimizer_layout if stage >= 2 else w.layout)
        assert w.stored_layout == (w.optimizer_layout if stage == 3 else w.layout)


@pytest.mark.parametrize("strategy, world", [({"dp": 4, "ep": 2, "zero": {"stage": 1}}, 4),
                                             ({"dp": 2, "tp": 2, "ep": 2, "etp": 1, "zero": {"stage": 3}}, 4)])
def test_every_expert_moment_is_tiled_once_by_the_ranks_pieces(strategy, world):
    """The plan's optimizer-state pieces (what a checkpoint writes, optim_pieces) and the shared engine's
    (ZeroPlan.owned: the segments each rank updates) of every expert moment: the primary ones of all
    ranks cover each element exactly once, each a 1/edp slice of the rank's expert shard, and the two
    agree rank for rank; MindSpore's strategy-file entry names the same split (opt_shard_size edp)."""
    plan = plan_for(strategy, world, MOE)
    edp = plan.strategy.edp
    zplan = zero_plan(plan)
    experts = [n for n, q in plan.params.items() if q.kind.startswith("expert")]
    entries = stage_param_entries(plan, 0)
    for name in experts:
        q = plan.params[name]
        count = np.zeros(q.shape, dtype=int)
        for rank in range(world):
            piece = optim_pieces(plan, rank, STATES)[optim_name("exp_avg", name)]
            owned = [o for o in zplan.owned(rank) if o.name == name]
            assert [Region(*o.global_box) for o in owned] == [piece.region]
            assert [o.primary for o in owned] == [piece.primary]
            assert np.prod(piece.region.sizes) * edp == np.prod(q.layout.local_shape())
            if piece.primary:
                count[tuple(slice(o, o + s) for o, s in zip(piece.region.offsets, piece.region.sizes))] += 1
        assert (count == 1).all(), name
        entry, held = entries[name]
        assert (entry.opt_shard_size, held) == (edp, q.optimizer_layout)


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
