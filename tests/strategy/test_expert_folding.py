"""Expert parallel folding (Megatron-core's MoE parallel folding): the routed experts' mesh (edp, ep, etp)
over the same ranks as the dense (dp, cp, tp); every rank's expert piece, the named groups (against
megatron-core's own rank generator), the experts' ZeRO over edp, and what the cost model charges for it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.cost import communication, estimate, memory
from ms_llm.strategy.devices import DEVICES
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan
from ms_llm.strategy.report import plan_report, strategy_summary
from ms_llm.strategy.shape import cost_shape

MOE = from_dict(ModelConfig, {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
                              "ffn_hidden_size": 256, "max_seq_len": 256,
                              "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32}}, "model")
TRAIN = TrainConfig(global_batch_size=16, micro_batch_size=1, seq_len=64)
GATE = "model.layers.0.mlp.experts.gate_proj.weight"      # (E, F, H): E over ep, F over etp
DOWN = "model.layers.0.mlp.experts.down_proj.weight"      # (E, H, F): E over ep, F over etp


def make(strategy: dict, world: int):
    return plan(MOE, from_dict(ParallelStrategy, strategy, "strategy"), TRAIN, world)


def pieces(p, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    layout = p.params[name].layout
    return [layout.shard_box(p.stage_rank(r)) for r in range(p.world_size)]


def test_etp_defaults_to_tp_and_keeps_every_existing_layout():
    """A strategy written before etp existed (ep over dp*cp, experts' width over tp) gives every rank the
    piece it had: experts by ep = the rank's position in dp*cp modulo ep, width by its tp position."""
    p = make({"dp": 4, "tp": 2, "ep": 2}, 8)
    assert (p.strategy.etp, p.strategy.edp) == (2, 2) and p.expert_mesh.shape == (1, 2, 2, 2)
    for r, (offsets, sizes) in enumerate(pieces(p, GATE)):
        dp_cp, tp = divmod(r, 2)
        assert offsets == ((dp_cp % 2) * 4, tp * 16, 0) and sizes == (4, 16, 64)
    # the expert groups are the dense ones: etp = the tp group, ep inside dp
    assert p.expert_mesh.groups("etp") == p.mesh.groups("tp")
    assert p.expert_mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_ep4_folded_over_dp2_x_tp2_keeps_experts_whole():
    p = make({"dp": 2, "tp": 2, "ep": 4, "etp": 1}, 4)
    assert p.expert_mesh.describe() == "pp1 x edp1 x ep4 x etp1"
    assert p.expert_mesh.groups("ep") == [[0, 1, 2, 3]]                      # across both dp and tp
    for r, (offsets, sizes) in enumerate(pieces(p, DOWN)):
        assert offsets == (2 * r, 0, 0) and sizes == (2, 64, 32)             # two whole experts each


def test_ep2_x_etp2_carved_out_of_dp():
    p = make({"dp": 4, "ep": 2, "etp": 2}, 4)
    em = p.expert_mesh
    assert (em.groups("etp"), em.groups("ep"), em.groups("edp")) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]],
                                                                     [[0], [1], [2], [3]])
    for r, (offsets, sizes) in enumerate(pieces(p, GATE)):
        ep, etp = divmod(r, 2)
        assert offsets == (4 * ep, 16 * etp, 0) and sizes == (4, 16, 64)
    for r, (offsets, sizes) in enumerate(pieces(p, DOWN)):            # row-parallel: F is dim 2
        ep, etp = divmod(r, 2)
        assert offsets == (4 * ep, 0, 16 * etp) and sizes == (4, 64, 16)


def test_expert_zero_shards_over_the_expert_data_parallel_group():
    """ZeRO over edp: dp2 x tp2 with ep2 x etp1 leaves edp 2, and the experts' optimizer states split over
    it, inside each rank's expert piece; the two edp ranks' halves make up that piece."""
    p = make({"dp": 2, "tp": 2, "ep": 2, "etp": 1, "zero": {"stage": 1}}, 4)
    w = p.params[GATE]
    assert p.strategy.edp == 2 and p.expert_mesh.groups("edp") == [[0, 2], [1, 3]]
    assert w.optimizer_layout.axes_of(0) == ("ep", "edp") and w.optimizer_layout.local_shape() == (2, 32, 64)
    for group in p.expert_mesh.groups("edp"):
        boxes = sorted(w.optimizer_layout.shard_box(r) for r in group)
        (first, size), (second, _) = boxes
        assert w.layout.shard_box(group[0]) == w.layout.shard_box(group[1]) == ((first[0], 0, 0), (4, 32, 64))
        assert second[0] == first[0] + size[0]


def test_cost_model_charges_expert_memory_and_the_folded_dispatch():
    """Experts per rank shrink with ep * etp; with etp != tp each tp rank sends a 1/tp share of its
    copies over ep, and the etp ranks gather them (the 'etp' axis)."""
    s = {"dp": 4, "tp": 2, "zero": {"stage": 1}}
    plans = {name: make({**s, **extra}, 8) for name, extra in
             (("ep2", {"ep": 2}), ("ep4_etp1", {"ep": 4, "etp": 1}), ("ep2_etp1", {"ep": 2, "etp": 1}))}
    mem = {n: memory(cost_shape(p)) for n, p in plans.items()}
    experts = {n: sum(q.numel for q in p.params.values() if q.kind.startswith("expert")) // (p.strategy.ep * p.strategy.etp)
               for n, p in plans.items()}
    assert experts == {"ep2": 2 * 8 * 32 * 64 * 3 // 4, "ep4_etp1": 2 * 8 * 32 * 64 * 3 // 4,
                       "ep2_etp1": 2 * 8 * 32 * 64 * 3 // 2}
    # bf16 weight and gradient (2 + 2 bytes), fp32 master and AdamW moments (12 bytes) over edp (2, 2, 4)
    for n, p in plans.items():
        assert mem[n].experts == pytest.approx(experts[n] * (4 + 12 / p.strategy.edp))
    vol = {n: communication(cost_shape(p)).bytes_by_axis for n, p in plans.items()}
    # a rank's token copies (64 tokens x top-2) of 64 bf16 features, over 2 MoE layers x 4 micro-batches
    copies = TRAIN.micro_batch_size * TRAIN.seq_len * 2 * 64 * 2 * 2 * TRAIN.global_batch_size // 4
    assert vol["ep2"]["ep"] == pytest.approx(4 * copies * 1 / 2) and "etp" not in vol["ep2"]
    assert vol["ep4_etp1"]["ep"] == pytest.approx(4 * copies / 2 * 3 / 4) and "etp" not in vol["ep4_etp1"]
    v = communication(cost_shape(make({"dp": 8, "ep": 2, "etp": 2}, 8))).bytes_by_axis     # 2 micro-batches
    assert v["etp"] == pytest.approx(4 * copies / 2) and v["ep"] == pytest.approx(4 * copies / 2 / 2)


def test_report_names_the_expert_mesh_and_groups():
    p = make({"dp": 2, "tp": 2, "ep": 4, "etp": 1}, 4)
    assert "ep4, etp1" in strategy_summary(p)
    text = plan_report(p, estimate(cost_shape(p), DEVICES["h100"]), DEVICES["h100"])
    assert "experts    pp1 x edp1 x ep4 x etp1" in text and "ep: 1 group of 4, rank 0 in [0, 1, 2, 3]" in text
    assert "(of which experts)" in text
    z3 = make({"dp": 4, "ep": 2, "zero": {"stage": 3}}, 4)
    text = plan_report(z3, estimate(cost_shape(z3), DEVICES["h100"]), DEVICES["h100"])
    assert "etp fastest; zero-3 over edp 2: optimizer states, gradients, weights)" in text


MEGATRON_GROUPS = """
import json, sys
from megatron.core.parallel_state import RankGenerator
out = {}
for name, (tp, cp, dp, pp, ep, etp) in json.loads(sys.argv[1]).items():
    world = tp * cp * dp * pp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out[name] = {"tp": dense.get_ranks("tp"), "dp": dense.get_ranks("dp"), "etp": experts.get_ranks("tp"),
                 "ep": experts.get_ranks("ep"), "edp": experts.get_ranks("dp"), "pp": experts.get_ranks("pp")}
print(json.dumps(out))
"""


def test_expert_groups_are_megatrons():
    """megatron-core's own rank generator (initialize_model_parallel's expert RankGenerator, order
    tp-cp-ep-dp-pp) gives the same tp / dp groups for attention and etp / ep / edp groups for the experts."""
    root = Path(__file__).resolve().parents[2]
    cases = {"ep4_dp2_tp2": (2, 1, 2, 1, 4, 1), "ep2_etp2_dp4": (1, 1, 4, 1, 2, 2),
             "ep2_tp2_default": (2, 1, 4, 1, 2, 2), "ep2_etp4_dp2_tp2_pp2": (2, 1, 4, 2, 2, 4),
             "ep8_dp2_tp4_pp2": (4, 1, 2, 2, 8, 1), "ep2_etp1_cp2_tp2": (2, 2, 2, 1, 2, 1)}
    proc = subprocess.run([sys.executable, "-c", MEGATRON_GROUPS, json.dumps(cases)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root / ".oracles")}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (tp, cp, dp, pp, ep, etp) in cases.items():
        p = plan(MOE, ParallelStrategy(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp),
                 TrainConfig(global_batch_size=dp * 4, micro_batch_size=1, seq_len=64), tp * cp * dp * pp)
        em = p.expert_mesh
        ours = {"tp": p.mesh.groups("tp"), "dp": p.mesh.groups("dp"), "etp": em.groups("etp"), "ep": em.groups("ep"),
                "edp": em.groups("edp"), "pp": em.groups("pp")}
        assert {k: sorted(v) for k, v in ours.items()} == {k: sorted(v) for k, v in theirs[name].items()}, name
