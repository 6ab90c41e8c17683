"""DeepSeek-class models in the plan and the cost model: the parameter counts equal the sum over the
real model's tensors (transformers' DeepseekV3 / DeepseekV2 / Qwen3Moe ForCausalLM, built on the meta
device from the published config.json values) and the published sizes; the plan lays out MLA as
Megatron-core's MLASelfAttention and puts the MTP modules beside lm_head; the cost model prices MLA,
activated experts only and the MTP work on its own stage."""
import dataclasses
import re

import pytest
import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from ms_llm import cli
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import StrategyError
from ms_llm.job import CONFIG_ROOT, load_job, load_section
from ms_llm.strategy.cost import (activation_bytes_per_token_layer, estimate, model_flops_per_token, shape_of,
                                  stage_flops_per_token, stage_memory)
from ms_llm.strategy.devices import get_device
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.layout import Replicate, Shard
from ms_llm.strategy.plan import plan
from ms_llm.strategy.shape import cost_shape
from ms_llm.strategy.validate import validate

# The config.json values of the published checkpoints (Hugging Face hub), as transformers reads them.
HF = {
    "deepseek_v3_671b": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, num_nextn_predict_layers=1)),
    "deepseek_v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, num_experts_per_tok=6, first_k_dense_replace=1)),
    "qwen3_30b_a3b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True)),
    "qwen3_235b_a22b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True)),
}
# Published sizes in billions, to the digits published: (total, activated).
PUBLISHED = {"deepseek_v3_671b": (671, 37), "qwen3_30b_a3b": (30, 3), "qwen3_235b_a22b": (235, 22)}


def hf_model(name: str, **changes):
    config_class, model_class, values = HF[name]
    with torch.device("meta"):
        return model_class(config_class(**{**values, **changes}))


def tensor_sums(model, top_k: int, num_experts: int) -> tuple[int, int]:
    """(every parameter, those one token uses): a routed expert tensor counts top_k / num_experts."""
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * top_k // num_experts if ".mlp.experts." in name else p.numel()
    return total, active


@pytest.mark.parametrize("name", list(HF))
def test_parameter_counts_equal_the_real_models_tensors(name):
    ours = load_section("model", name)
    total, active = tensor_sums(hf_model(name), ours.moe.top_k, ours.moe.num_experts)
    # transformers builds the main model (DeepseekV3 leaves the MTP layer of its checkpoint out).
    assert ours.num_params(mtp=False) == total
    assert ours.active_params(mtp=False) == active
    if name in PUBLISHED:
        assert (total // 10**9, active // 10**9) == PUBLISHED[name]
    print(f"{name}: {total:,} parameters, {active:,} activated")


def test_deepseek_v3_is_671b_with_37b_activated_and_its_mtp_module_the_checkpoints_layer_61():
    ours = load_section("model", "deepseek_v3_671b")
    assert 671e9 <= ours.num_params(mtp=False) < 672e9 and 37e9 <= ours.active_params(mtp=False) < 38e9
    # DeepSeek's checkpoint holds MTP module 0 as model.layers.61: a decoder layer (MoE, past
    # first_k_dense_replace) plus enorm, hnorm, eh_proj (h -> 2h) and shared_head.norm; embed_tokens and
    # shared_head.head are the main model's.
    config = DeepseekV3Config(**{**HF["deepseek_v3_671b"][2], "num_hidden_layers": 62})
    with torch.device("meta"):
        layer = DeepseekV3DecoderLayer(config, layer_idx=61)
    h = config.hidden_size
    module = sum(p.numel() for p in layer.parameters()) + 3 * h + 2 * h * h
    assert ours.mtp_param_count() == module
    assert ours.num_params() == ours.num_params(mtp=False) + module
    routed = sum(p.numel() for n, p in layer.named_parameters() if n.startswith("mlp.experts."))
    assert ours.active_params() - ours.active_params(mtp=False) == module - routed + routed * 8 // 256


def test_plan_names_and_shapes_are_transformers_own():
    """Every parameter of the plan is the transformers model's, under its name and shape; the routed
    experts stacked per projection (transformers 5 fuses gate and up) and the expert bias a buffer."""
    for name, tp in (("deepseek_v3_671b", 1), ("deepseek_v2_lite", 2), ("qwen3_30b_a3b", 4)):
        ours = load_section("model", name)
        p = plan(ours, from_dict(ParallelStrategy, {"tp": tp, "ep": 2, "dp": 2}), TrainConfig(global_batch_size=2))
        theirs = {n: tuple(t.shape) for n, t in hf_model(name).named_parameters()}
        mine = {n: q.shape for n, q in p.params.items() if not n.startswith("model.mtp.")}
        for n in [n for n in mine if n.endswith("mlp.experts.gate_proj.weight")]:
            e, f, h = mine.pop(n)
            assert mine.pop(n.replace("gate_proj", "up_proj")) == (e, f, h)
            mine[n.replace("gate_proj.weight", "gate_up_proj")] = (e, 2 * f, h)
            mine[n.replace("gate_proj.weight", "down_proj")] = mine.pop(n.replace("gate_proj", "down_proj"))
        assert mine == theirs
        buffers = {n for n, _ in hf_model(name).named_buffers() if "e_score_correction_bias" in n}
        assert set(p.buffers) - {n for n in p.buffers if n.startswith("model.mtp.")} == buffers


@pytest.mark.parametrize("name", [*HF, "tiny_deepseek"])
def test_the_plan_is_the_torch_models_parameters_and_buffers(name):
    """The torch backend's model (MTP modules included), built on the meta device: every parameter
    is the plan's under the same name and shape, every persistent buffer is a plan buffer, and the
    tensors add up to the counts `ms-llm plan` prints."""
    from torch_backend.model import Transformer
    ours = load_section("model", name)
    with torch.device("meta"):
        model = Transformer(ours)
    p = plan(ours, ParallelStrategy(), TrainConfig(global_batch_size=1, seq_len=64), 1)
    assert {n: tuple(t.shape) for n, t in model.named_parameters()} == {n: q.shape for n, q in p.params.items()}
    assert set(model.state_dict()) - set(dict(model.named_parameters())) == set(p.buffers)
    assert tensor_sums(model, ours.moe.top_k, ours.moe.num_experts) == (ours.num_params(), ours.active_params())


def make(name: str, strategy: dict, train: dict | None = None, **model_changes):
    model = dataclasses.replace(load_section("model", name), **model_changes)
    t = from_dict(TrainConfig, train or {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 32}, "train")
    return plan(model, from_dict(ParallelStrategy, strategy, "strategy"), t)


def tp_of(layout):
    return layout.placements[layout.mesh.names.index("tp")]


def test_mla_under_tp_splits_whole_heads_and_replicates_the_latents():
    p = make("deepseek_v3_671b", {"tp": 8, "pp": 1, "dp": 1})
    a, nh = p.model.mla, p.model.num_heads
    attn = {n.split("self_attn.")[1]: q for n, q in p.params.items() if n.startswith("model.layers.5.self_attn.")}
    # Megatron-core: linear_q_up_proj / linear_kv_up_proj column-parallel, linear_proj row-parallel,
    # the down-projections duplicated, q_layernorm / kv_layernorm on whole latents.
    assert {n: (q.kind, tp_of(q.layout)) for n, q in attn.items()} == {
        "q_a_proj.weight": ("latent", Replicate()), "q_a_layernorm.weight": ("latent_norm", Replicate()),
        "q_b_proj.weight": ("column", Shard(0)), "kv_a_proj_with_mqa.weight": ("latent", Replicate()),
        "kv_a_layernorm.weight": ("latent_norm", Replicate()), "kv_b_proj.weight": ("column", Shard(0)),
        "o_proj.weight": ("row", Shard(1))}
    # Rows are head-major, so each rank's slice is whole heads: 16 of 128.
    assert attn["q_b_proj.weight"].layout.local_shape() == (nh // 8 * a.qk_head_dim, a.q_lora_rank)
    assert attn["kv_b_proj.weight"].layout.local_shape() == (nh // 8 * (a.qk_nope_head_dim + a.v_head_dim),
                                                             a.kv_lora_rank)
    assert attn["o_proj.weight"].layout.local_shape() == (p.model.hidden_size, nh // 8 * a.v_head_dim)
    assert p.activations["kv_latent"].shape[-1] == a.kv_lora_rank + a.qk_rope_head_dim
    assert tp_of(p.activations["kv_latent"]) == Replicate() and tp_of(p.activations["v"]) == Shard(2)
    assert p.activations["v"].shape[-1] == a.v_head_dim and p.activations["k"].shape[-1] == a.qk_head_dim
    bias = p.buffers["model.layers.5.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (256,) and bias.dtype == "float32"
    assert all(isinstance(x, Replicate) for x in bias.layout.placements)
    lite = make("deepseek_v2_lite", {"tp": 4, "dp": 1})       # no query low-rank path: q_proj column-parallel
    q = lite.params["model.layers.0.self_attn.q_proj.weight"]
    assert q.kind == "column" and q.layout.local_shape() == (16 // 4 * 192, 2048)


def test_tp_must_divide_the_heads_under_mla():
    model = load_section("model", "tiny_deepseek")
    with pytest.raises(StrategyError) as err:
        validate(model, from_dict(ParallelStrategy, {"tp": 8, "dp": 1}), TrainConfig(global_batch_size=8), 8)
    text = str(err.value)
    assert re.search(r"strategy\.tp: model\.num_heads = 4 is not divisible by 8; multi-latent attention "
                     r"\(model\.mla\)", text)
    assert "num_kv_heads" not in text            # one problem, named once


def test_mtp_sits_beside_lm_head_on_the_last_stage():
    p = make("tiny_deepseek", {"pp": 2, "ep": 2, "dp": 2, "tp": 2})
    mtp = [q for n, q in p.params.items() if n.startswith("model.mtp.0.")]
    assert {q.stage for q in mtp} == {p.params["lm_head.weight"].stage} == {1}
    assert p.params["model.mtp.0.eh_proj.weight"].shape == (64, 128)
    assert p.params["model.mtp.0.layer.mlp.experts.gate_proj.weight"].kind == "expert_column"   # layer 2 is MoE
    assert p.buffers["model.mtp.0.layer.mlp.gate.e_score_correction_bias"].stage == 1
    assert [c.has_mtp for c in p.chunks] == [False, True] and p.embedding_stages() == (0, 1)
    assert any("stage 1 keeps a copy" in n for n in p.notes)
    assert sum(q.numel for q in p.params.values()) == p.model.num_params()
    # The V schedule brings the last chunk back to rank 0, beside the embedding: no copy.
    v = make("tiny_deepseek", {"pp": 2, "dp": 1, "pipeline": {"schedule": "zbv", "virtual_stages": 2}},
             {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32}, num_layers=4)
    assert v.params["model.mtp.0.norm.weight"].stage == 0 and v.embedding_stages() == (0,)


MLA_CASES = [
    ("tiny_deepseek", {"tp": 2, "pp": 2, "ep": 2, "dp": 2, "zero": {"stage": 1}}, {}),
    ("tiny_deepseek", {"pp": 2, "dp": 1, "pipeline": {"schedule": "zbv", "virtual_stages": 2},
                       "recompute": {"policy": "full"}}, {"num_layers": 4}),
    ("tiny_deepseek", {"pp": 2, "dp": 2, "tp": 2, "cp": 2, "sequence_parallel": True}, {"mtp_layers": 2}),
    ("deepseek_v2_lite", {"tp": 2, "cp": 2, "ep": 4, "dp": 2, "zero": {"stage": 3}}, {}),
    ("qwen3_30b_a3b", {"tp": 2, "pp": 4, "ep": 4, "dp": 4, "recompute": {"policy": "selective"}}, {}),
]


@pytest.mark.parametrize("name,strategy,changes", MLA_CASES)
def test_the_search_prices_these_models_as_the_plan_does(name, strategy, changes):
    p = make(name, strategy, {"global_batch_size": 16, "micro_batch_size": 1, "seq_len": 64}, **changes)
    shape = shape_of(p.model, p.strategy, p.train)
    assert cost_shape(p) == shape
    assert estimate(p, get_device("h800")) == estimate(shape, get_device("h800"))


def test_shipped_deepseek_job_plans_as_the_search_prices_it():
    job = load_job(CONFIG_ROOT / "train" / "deepseek_v3_671b_h800.yaml")
    p = plan(job.model, job.strategy, job.train)
    assert cost_shape(p) == shape_of(job.model, p.strategy, job.train)
    est = estimate(p, get_device(job.device))
    assert est.fits and est.memory.stage == 0
    # DeepSeek's published 1,540 tokens/s per H800 (bench/deepseek_cost.py puts them side by side):
    # the estimate, bf16 with the all-to-all exposed, is within a factor of 2.5 below it.
    assert 1540 / 2.5 < est.tokens_per_s_per_device < 1540


def test_moe_flops_count_the_activated_experts_only():
    model = load_section("model", "deepseek_v3_671b")
    more = dataclasses.replace(model, moe=dataclasses.replace(model.moe, num_experts=512))
    # Twice the experts, the same top_k: only the router (which scores every expert) grows.
    routers = len(model.moe_layers) + model.mtp_layers
    assert model_flops_per_token(more, 4096) - model_flops_per_token(model, 4096) == 6 * 256 * 7168 * routers
    assert more.num_params() > 1.9 * model.num_params()
    job = load_job(CONFIG_ROOT / "train" / "deepseek_v3_671b_h800.yaml")
    s = validate(model, job.strategy, job.train)
    per_stage = stage_flops_per_token(shape_of(model, s, job.train))
    # The stages' work is the model's: 6 x every activated parameter but the embedding lookup, causal
    # attention of every layer, and each MTP module's pass through lm_head.
    assert sum(per_stage) == pytest.approx(model_flops_per_token(model, 4096) - 6 * model.vocab_size * 7168)
    # The last stage: 1 layer, lm_head and the MTP module (a layer, eh_proj, lm_head again): with 1
    # layer against the others' 4 it still sets the pace.
    layer = per_stage[3] / 4
    head = 6 * model.vocab_size * 7168
    mtp = 6 * (2 * 7168 ** 2 + 3 * 7168) + layer + head
    assert per_stage[15] == pytest.approx(layer + head + mtp) and per_stage[15] == max(per_stage)
    assert 1.2 < 16 * max(per_stage) / sum(per_stage) < 1.25


def test_mtp_work_and_memory_land_on_the_head_stage():
    model = load_section("model", "tiny_deepseek")
    train = TrainConfig(global_batch_size=8, micro_batch_size=1, seq_len=64)
    s = validate(model, from_dict(ParallelStrategy, {"pp": 2, "dp": 1}), train)
    without = dataclasses.replace(model, mtp_layers=0)
    with_mtp, plain = shape_of(model, s, train), shape_of(without, s, train)
    assert stage_flops_per_token(with_mtp)[0] == stage_flops_per_token(plain)[0]
    extra = stage_flops_per_token(with_mtp)[1] - stage_flops_per_token(plain)[1]
    assert extra == pytest.approx(model_flops_per_token(model, 64) - model_flops_per_token(without, 64))
    assert with_mtp.stages[1].mtp_layers == 1 and with_mtp.stages[0].mtp_layers == 0
    # The head's stage: the MTP module's parameters and an embedding copy, its layer's activations and
    # a second set of logits.
    embed = model.vocab_size * model.hidden_size
    assert with_mtp.stages[1].params - plain.stages[1].params == model.mtp_param_count() + embed
    mem, mem_plain = stage_memory(with_mtp, 1), stage_memory(plain, 1)
    assert mem.logits == 2 * mem_plain.logits and mem.activations > mem_plain.activations


def test_mla_activations_keep_the_latents_whole_and_split_the_heads():
    """Per token and layer, tp divides q, the expanded K/V and the attention output, not the latents."""
    model = load_section("model", "deepseek_v3_671b")
    train = TrainConfig(global_batch_size=8, micro_batch_size=1, seq_len=4096)
    a = model.mla
    per_layer = {}
    for tp in (1, 2):
        s = validate(model, from_dict(ParallelStrategy, {"tp": tp, "dp": 1, "sequence_parallel": tp > 1}), train, tp)
        per_layer[tp] = activation_bytes_per_token_layer(shape_of(model, s, train), "none")
    latent = 2 * (2 * a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + a.kv_lora_rank)   # bf16 bytes
    assert per_layer[1] - latent == pytest.approx(2 * (per_layer[2] - latent))


@pytest.mark.parametrize("job,header", [
    ("deepseek_v3_671b_h800", "deepseek_v3_671b (671B params, 37.6B activated + 11.6B MTP (688M activated)) "
                              "on 2048 x NVIDIA H800"),
    ("qwen3_30b_a3b_h100", "qwen3_30b_a3b (30.5B params, 3.35B activated) on 64 x NVIDIA H100")])
def test_ms_llm_plan_prints_the_counts_of_the_shipped_jobs(job, header, capsys):
    assert cli.main(["plan", str(CONFIG_ROOT / "train" / f"{job}.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"ms-llm plan: {header}" in out and "(fits)" in out
