"""ModelPlan: Megatron / MindFormers layout rules, stage maps, recompute, ZeRO partition."""
import numpy as np
import pytest

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.layout import Partial, Replicate, Shard
from ms_llm.strategy.plan import plan

MODEL = ModelConfig(vocab_size=512, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                    ffn_hidden_size=768, max_seq_len=1024, dtype="float32")
TRAIN = TrainConfig(global_batch_size=16, micro_batch_size=1, seq_len=256)


def make(strategy: dict, world: int, model=MODEL, train=TRAIN):
    return plan(model, from_dict(ParallelStrategy, strategy, "strategy"), train, world)


def tp_placement(p):
    return p.layout.placements[p.layout.mesh.names.index("tp")]


def test_megatron_layout_rules():
    p = make({"dp": 2, "tp": 2}, 4)
    params = p.params
    for name in ("q_proj", "k_proj", "v_proj"):
        assert tp_placement(params[f"model.layers.0.self_attn.{name}.weight"]) == Shard(0)
    for name in ("gate_proj", "up_proj"):
        assert tp_placement(params[f"model.layers.3.mlp.{name}.weight"]) == Shard(0)
    assert tp_placement(params["model.layers.0.self_attn.o_proj.weight"]) == Shard(1)
    assert tp_placement(params["model.layers.0.mlp.down_proj.weight"]) == Shard(1)
    assert tp_placement(params["model.embed_tokens.weight"]) == Shard(0)
    assert tp_placement(params["lm_head.weight"]) == Shard(0)
    assert tp_placement(params["model.layers.0.input_layernorm.weight"]) == Replicate()
    assert params["model.layers.0.self_attn.k_proj.weight"].layout.local_shape() == (64, 256)
    assert len(params) == 2 + 1 + 9 * MODEL.num_layers


def test_sequence_parallel_and_context_parallel_activations():
    p = make({"dp": 1, "tp": 2, "cp": 2, "sequence_parallel": True}, 4)
    acts = p.activations
    assert acts["hidden"].axes_of(1) == ("cp", "tp")
    assert acts["attn_input"].axes_of(1) == ("cp",)
    assert acts["q"].axes_of(2) == ("tp",)
    assert acts["o_proj_output"].placements[-1] == Partial()
    assert acts["logits"].axes_of(2) == ("tp",)
    no_sp = make({"dp": 1, "tp": 2}, 2)
    assert no_sp.activations["hidden"].split_count(1) == 1 and "tp" not in no_sp.activations["hidden"].axes_of(1)


def test_local_params_add_up():
    p = make({"dp": 1}, 1)
    assert p.local_param_count(0) == MODEL.num_params()
    p = make({"dp": 1, "tp": 2, "pp": 2}, 4)
    per_rank = p.local_param_count(0) + p.local_param_count(1)
    assert per_rank * 2 == MODEL.num_params() - 2 * MODEL.hidden_size * MODEL.num_layers - MODEL.hidden_size + \
        2 * MODEL.hidden_size * MODEL.num_layers + MODEL.hidden_size + \
        (2 * MODEL.hidden_size * MODEL.num_layers + MODEL.hidden_size)  # norms are replicated on tp


def test_even_pipeline_split():
    p = make({"dp": 1, "pp": 2}, 2)
    assert [c.layers for c in p.chunks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert p.params["model.embed_tokens.weight"].stage == 0
    assert p.params["lm_head.weight"].stage == 1 and p.params["model.norm.weight"].stage == 1
    assert p.layer_stage(5) == (1, 0)


def test_interleaved_chunks_loop_over_ranks():
    p = make({"dp": 1, "pp": 2, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, 2)
    assert [(c.stage, c.virtual, c.layers) for c in p.chunks] == [
        (0, 0, (0, 1)), (1, 0, (2, 3)), (0, 1, (4, 5)), (1, 1, (6, 7))]
    assert p.params["lm_head.weight"].stage == 1


def test_v_schedule_returns_to_rank_zero():
    p = make({"dp": 1, "pp": 2, "pipeline": {"schedule": "zbv", "virtual_stages": 2}}, 2)
    assert [(c.stage, c.virtual) for c in p.chunks] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert p.params["lm_head.weight"].stage == 0 and p.params["model.embed_tokens.weight"].stage == 0


def test_explicit_layer_split_and_recompute_per_stage():
    p = make({"dp": 1, "pp": 2, "pipeline": {"layer_split": [3, 5]},
              "recompute": {"policy": "full", "num_layers": 2}}, 2)
    assert [c.layers for c in p.chunks] == [(0, 1, 2), (3, 4, 5, 6, 7)]
    assert p.recompute == ("full", "full", "none", "full", "full", "none", "none", "none")
    assert make({"dp": 1, "recompute": {"policy": "selective"}}, 1).recompute == ("selective",) * 8


def test_zero_partition_and_layouts():
    p = make({"dp": 4, "cp": 2, "zero": {"stage": 2}}, 8, train=TrainConfig(global_batch_size=16, seq_len=256))
    assert (p.zero.axes, p.zero.group_size, p.zero.replicate_size) == (("dp_shard", "cp"), 8, 1)
    assert (p.zero.shard_optimizer, p.zero.shard_grads, p.zero.shard_params) == (True, True, False)
    hsdp = make({"dp": 4, "zero": {"stage": 3, "shard_size": 2}}, 4)
    assert (hsdp.zero.group_size, hsdp.zero.replicate_size) == (2, 2)
    assert hsdp.mesh.shape == (1, 2, 2, 1, 1)
    assert make({"dp": 4}, 4).mesh.shape == (1, 4, 1, 1, 1)


def test_zero_layout_splits_the_tp_shard_further():
    p = make({"dp": 2, "tp": 2, "zero": {"stage": 1}}, 4)
    q = p.params["model.layers.0.self_attn.k_proj.weight"]        # (128, 256), tp splits rows
    full = np.arange(128 * 256).reshape(128, 256)
    stage_mesh = p.stage_mesh
    for rank in range(stage_mesh.size):
        (r0, c0), (rs, cs) = q.layout.shard_box(rank)
        (z0, _), (zs, _) = q.zero_layout.shard_box(rank)
        assert zs == rs // 2 and r0 <= z0 < r0 + rs        # the ZeRO piece lies inside this rank's tp shard
    assert q.optimizer_layout == q.zero_layout and q.grad_layout == q.layout == q.stored_layout
    boxes = {q.zero_layout.shard_box(r) for r in range(stage_mesh.size)}
    assert len(boxes) == 4 and sum(b[1][0] * b[1][1] for b in boxes) == full.size


def test_experts_split_over_ep():
    moe = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, ffn_hidden_size=512,
                      moe=MoEConfig(num_experts=8, top_k=2))
    p = make({"dp": 4, "ep": 4}, 4, model=moe)
    w = p.params["model.layers.0.mlp.experts.gate_proj.weight"]
    assert w.shape == (8, 512, 256) and w.layout.axes_of(0) == ("ep",) and w.layout.local_shape()[0] == 2
    assert p.expert_mesh.shape == (1, 1, 4, 1)
