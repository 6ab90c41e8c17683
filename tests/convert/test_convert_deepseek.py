"""DeepSeek-class and Qwen3-MoE models through the converters: every MindFormers 2.1 pretrain config
converts (or names the one field it cannot express) with the fields that survive asserted; ms_llm ->
MindFormers 2.x / Megatron / torchtitan -> ms_llm keeps multi-latent attention, multi-token
prediction and the DeepSeekMoE routing, or names each field a format cannot hold. (The peers' own
parsers read what we write in test_convert_peers.py.)"""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from ms_llm.config.model import MLAConfig, MoEConfig, ModelConfig, RopeScaling
from ms_llm.convert import ConversionError, ReadOptions, dump, from_job, read
from ms_llm.convert.torchtitan import flavors
from ms_llm.job import job_from_dict, load_section

SHIPPED = Path(__file__).resolve().parents[2] / ".oracles" / "configs"
PRETRAIN = {p.stem: p for p in SHIPPED.glob("*/*pretrain*.yaml")}
SUFFIX = {"ms_llm": ".yaml", "megatron": ".sh", "mindformers": ".yaml", "mindformers2": ".yaml", "torchtitan": ".sh",
          "torchtitan_toml": ".toml"}

# ---- every MindFormers 2.1 pretrain config -----------------------------------------------------------

MLA_V3 = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
YARN_40 = RopeScaling(type="yarn", factor=40.0, original_max_seq_len=163840, mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK_MOE = {"shared_experts": 1, "first_dense_layers": 1, "score_function": "sigmoid", "expert_bias": True,
                "bias_update_rate": 1e-3, "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 1e-3}
# The model each config reads as (fields not listed are asserted at ModelConfig's defaults, MLA's aside),
# and the one model warning it may carry.
MODELS = {
    "pretrain_deepseek3_671b": (
        {"mla": MLA_V3, "mtp_layers": 1, "mtp_loss_factor": 0.3,
         "moe": MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden_size=2048, **{
             **DEEPSEEK_MOE, "first_dense_layers": 3, "routed_scaling_factor": 2.5, "num_groups": 8, "group_top_k": 4,
             "bias_update_rate": 1e-4, "seq_aux_loss_coeff": 1e-4})},
        "multiplies the softmax scale of its multi-latent attention by (0.1 x mscale 0.707 x ln(rotary_scaling_"
        "factor 40) + 1)^2 = 1.59 even with plain rotary"),
    "pretrain_deepseek3_12b_16p_pp16": (
        {"mla": dataclasses.replace(MLA_V3, v_head_dim=192), "rope_scaling": YARN_40, "mtp_layers": 1,
         "moe": MoEConfig(num_experts=64, top_k=8, expert_ffn_hidden_size=2048, routed_scaling_factor=1.5,
                          num_groups=8, group_top_k=4, **DEEPSEEK_MOE)}, None),        # groups: the class default
    "pretrain_deepseek3_1b_8p_pynative": (
        {"mla": dataclasses.replace(MLA_V3, v_head_dim=192), "rope_scaling": YARN_40, "mtp_layers": 1,
         "moe": MoEConfig(num_experts=8, top_k=4, expert_ffn_hidden_size=1024, routed_scaling_factor=2.5,
                          num_groups=4, group_top_k=2, **DEEPSEEK_MOE)}, None),
    "pretrain_telechat3_105b_a4b_4k": (
        {"mla": MLA_V3, "mtp_layers": 1, "mtp_loss_factor": 0.2,
         "moe": MoEConfig(num_experts=192, top_k=4, expert_ffn_hidden_size=1536, routed_scaling_factor=2.8,
                          **DEEPSEEK_MOE)}, None),
    "pretrain_qwen3_30b_a3b_4k": (
        {"qk_norm": True, "head_dim": 128, "num_kv_heads": 4,
         "moe": MoEConfig(num_experts=128, top_k=8, expert_ffn_hidden_size=768, normalize_top_k=False,
                          aux_loss_coeff=1e-3, routed_scaling_factor=1.5)},
        "moe_router_load_balancing_type = gbs_aux_loss (the balance loss over the global batch): not expressible"),
    "pretrain_qwen3_32b_4k": ({"qk_norm": True, "head_dim": 128, "num_kv_heads": 8}, None),
    "pretrain_telechat3_36b": ({"num_kv_heads": 8}, None),
}
DSV4 = "model.experimental_attention_variant: 'dsv4_hybrid' \\(DeepSeek-V4's compressed sparse attention"
REFUSED = {"pretrain_deepseek4_flash": DSV4, "pretrain_deepseek4_flash_reduction": DSV4,
           "pretrain_deepseek4_pro": DSV4, "pretrain_deepseek4_pro_reduction": DSV4,
           # MindFormers' LayerSetting refuses it too; read with an offset it takes below
           "pretrain_telechat3_105b_a4b_4k": "model.model_config.offset: 0, but 45 layers over 8 pipeline chunks"}
GIVEN = ("llm_pretrain_dense_template", "llm_pretrain_moe_template")     # the shape is in a Hugging Face folder
WORLD = {"pretrain_deepseek3_1b_8p_pynative": 8, "pretrain_deepseek4_flash": 8, "pretrain_deepseek4_pro": 8,
         "pretrain_deepseek4_flash_reduction": 8, "pretrain_deepseek4_pro_reduction": 8}


def _read(stem: str, as_shipped: bool = False, **options):
    text = PRETRAIN[stem].read_text()
    if stem == "pretrain_telechat3_105b_a4b_4k" and not as_shipped:
        text = text.replace("    offset: 0\n", "    offset: [1, 1, 1, 1, 1, 0, 0, 0]\n")
    return read(text, str(PRETRAIN[stem]), "mindformers", ReadOptions(world_size=WORLD.get(stem), **options))


def test_every_pretrain_config_is_accounted_for():
    assert len(PRETRAIN) == 13 and set(PRETRAIN) == set(MODELS) | set(REFUSED) | set(GIVEN)


@pytest.mark.parametrize("stem", sorted(REFUSED))
def test_configs_it_cannot_express_name_the_field(stem):
    with pytest.raises(ConversionError, match=REFUSED[stem]):
        _read(stem, as_shipped=True)


@pytest.mark.parametrize("stem", GIVEN)
def test_templates_take_the_model_given(stem):
    conv = _read(stem, model=load_section("model", "qwen3_32b"))
    assert dataclasses.replace(conv.job.model, name="qwen3_32b", dtype="bfloat16") == load_section("model", "qwen3_32b")


@pytest.mark.parametrize("stem", sorted(MODELS))
def test_shipped_config_keeps_attention_routing_and_mtp(stem):
    fields, note = MODELS[stem]
    conv = _read(stem)
    m = conv.job.model
    want = {"mla": None, "moe": None, "qk_norm": False, "mtp_layers": 0, "mtp_loss_factor": 0.3,
            "rope_scaling": RopeScaling(), **fields}
    assert {k: getattr(m, k) for k in want} == want
    assert m.mla is None or (m.head_dim, m.num_kv_heads) == (m.mla.qk_head_dim, m.num_heads)
    model_notes = [w for w in conv.warnings if w.startswith("model")]
    assert model_notes == ([] if note is None else [next(w for w in model_notes if note in w)])


def _deepseek_v3_count(cfg: dict) -> int:
    """DeepSeek-V3's parameters from the YAML's own shape keys (DeepseekV3Config's defaults for the
    ones it leaves out), without MTP: the published 671B."""
    c = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
         "first_k_dense_replace": 3, **cfg}
    h, n, q, kv = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (h * q + q + q * n * qk + h * (kv + c["qk_rope_head_dim"]) + kv
                 + kv * n * (c["qk_nope_head_dim"] + c["v_head_dim"]) + n * c["v_head_dim"] * h)
    dense = 3 * h * c["intermediate_size"]
    experts = c["n_routed_experts"] * h + (c["n_routed_experts"] + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"]
    k, layers = c["first_k_dense_replace"], c["num_hidden_layers"]
    return 2 * c["vocab_size"] * h + h + layers * (attention + 2 * h) + k * dense + (layers - k) * experts


def test_deepseek3_671b_converts_to_the_published_model():
    """MLA, MTP and the routing kept, 671.0B parameters as its own shape keys count them (37.6B
    activated), no warning about the model but MindFormers' softmax temperature, and its expert
    parallel 32 over data_parallel 4 x model_parallel 8 kept: whole experts (etp 1), ep folded over
    the tensor-parallel ranks too, as its grouped-GEMM experts run."""
    conv = _read("pretrain_deepseek3_671b")
    m = conv.job.model
    cfg = yaml.safe_load(PRETRAIN["pretrain_deepseek3_671b"].read_text())["model"]["model_config"]
    assert m.num_params(mtp=False) == _deepseek_v3_count(cfg)
    assert (round(m.num_params(mtp=False) / 1e9, 1), round(m.active_params(mtp=False) / 1e9, 1)) == (671.0, 37.6)
    text = "\n".join(conv.warnings)
    for key in ("multi_latent_attention", "qk_layernorm", "num_nextn_predict_layers", "mtp_loss_factor", "n_group",
                "topk_group", "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "seq_aux_loss",
                "TopkBiasBalanceCallback", "first_k_dense_replace"):
        assert not re.search(rf"\b{key}\b", text), key
    s = conv.job.strategy
    assert (s.dp, s.tp, s.ep, s.etp, s.edp) == (4, 8, 32, 1, 1)
    assert not re.search(r"expert_parallel|expert_model_parallel|strategy\.e", text)
    # the job we write back is MindFormers' DeepseekV3 with the same keys, plain softmax scale spelled out
    mc = yaml.safe_load(dump(conv, "mindformers2").text)["model"]["model_config"]
    assert {k: mc[k] for k in ("model_type", "n_routed_experts", "n_group", "topk_group", "first_k_dense_replace",
                               "moe_router_load_balancing_type", "moe_aux_loss_coeff", "num_nextn_predict_layers",
                               "rotary_scaling_factor")} == \
        {"model_type": "deepseek_v3", "n_routed_experts": 256, "n_group": 8, "topk_group": 4,
         "first_k_dense_replace": 3, "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4,
         "num_nextn_predict_layers": 1, "rotary_scaling_factor": 1.0}
    written = dump(conv, "mindformers2")
    assert not any("strategy.e" in w for w in written.warnings)
    back = read(written.text, "back.yaml", "mindformers")
    assert back.job.model == m and not any(w.startswith("model") for w in back.warnings)
    assert back.job.strategy.ep == 32 and back.job.strategy.etp == 1


def test_the_expert_bias_moves_only_with_its_callback():
    """MindFormers moves the bias in TopkBiasBalanceCallback; without it the bias stays at zero."""
    text = PRETRAIN["pretrain_deepseek3_671b"].read_text().replace("  - type: TopkBiasBalanceCallback\n", "")
    conv = read(text, "671b.yaml", "mindformers")
    assert (conv.job.model.moe.expert_bias, conv.job.model.moe.bias_update_rate) == (True, 0.0)
    assert any("without a TopkBiasBalanceCallback" in w for w in conv.warnings)
    shipped = _read("pretrain_deepseek3_671b")
    assert {"type": "TopkBiasBalanceCallback"} in yaml.safe_load(dump(shipped, "mindformers2").text)["callbacks"]
    assert "TopkBiasBalanceCallback" not in dump(shipped, "mindformers").text       # r1.x's LLaMA has no bias


@pytest.mark.parametrize("old,new,message", [
    ("    moe_router_enable_expert_bias: True\n", "    moe_router_enable_expert_bias: True\n    moe_router_score_function: "
     "softmax\n", "moe_router_enable_expert_bias: True needs sigmoid scores"),
    ("    n_group: 8\n", "    n_group: 8\n    moe_layer_freq: 2\n", "moe_layer_freq: 2 contradicts first_k_dense_replace: 3"),
])
def test_routing_mindformers_refuses_names_the_key(old, new, message):
    text = PRETRAIN["pretrain_deepseek3_671b"].read_text()
    assert old in text
    with pytest.raises(ConversionError, match=message):
        read(text.replace(old, new), "671b.yaml", "mindformers")


def test_moe_layer_flags_read_as_dense_layers():
    text = PRETRAIN["pretrain_deepseek3_12b_16p_pp16"].read_text().replace(
        "    first_k_dense_replace: 1\n", "    first_k_dense_replace: 0\n    moe_layer_freq: [0, 1, 1, 0, 1, 1, 1, 1, 1, "
                                         "1, 1, 1, 1, 1, 1, 1]\n")
    m = read(text, "12b.yaml", "mindformers").job.model
    assert (m.moe.first_dense_layers, m.moe.layer_freq, m.moe.dense_layers) == (1, 1, (3,))
    assert yaml.safe_load(dump(from_job(job_from_dict({"name": "x", "model": dataclasses.asdict(m), "strategy": {},
                                                       "train": {"seq_len": 4096}}), 1), "mindformers2").text)[
        "model"]["model_config"]["moe_layer_freq"] == [0, 1, 1, 0] + [1] * 12


# ---- ms_llm -> a peer's format -> ms_llm ---------------------------------------------------------------

BASE = {"vocab_size": 320, "hidden_size": 64, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 128,
        "max_seq_len": 4096}
# Small members of each family with every field of theirs away from its default.
FAMILIES = {
    "deepseek_v3": {**BASE, "mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                    "qk_rope_head_dim": 8, "v_head_dim": 16},
                    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_seq_len": 4096, "mscale": 1.0,
                                     "mscale_all_dim": 1.0},
                    "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "shared_experts": 1,
                            "first_dense_layers": 1, "score_function": "sigmoid", "routed_scaling_factor": 2.5,
                            "num_groups": 4, "group_top_k": 2, "expert_bias": True, "bias_update_rate": 1e-4,
                            "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 1e-4},
                    "mtp_layers": 1, "mtp_loss_factor": 0.2},
    "deepseek_v2": {**BASE, "mla": {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                    "qk_rope_head_dim": 8, "v_head_dim": 16},
                    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_seq_len": 4096, "mscale": 0.707,
                                     "mscale_all_dim": 0.707},
                    "moe": {"num_experts": 8, "top_k": 3, "expert_ffn_hidden_size": 32, "shared_experts": 2,
                            "first_dense_layers": 1, "normalize_top_k": False, "aux_loss_coeff": 0.0,
                            "seq_aux_loss_coeff": 1e-3}},
    "qwen3_moe": {**BASE, "num_kv_heads": 2, "head_dim": 32, "qk_norm": True,
                  "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "aux_loss_coeff": 1e-3,
                          "routed_scaling_factor": 1.5}},
    "qwen3_moe_mlp_only": {**BASE, "num_kv_heads": 2, "qk_norm": True,
                           "moe": {"num_experts": 8, "top_k": 2, "dense_layers": [0, 2], "aux_loss_coeff": 1e-3,
                                   "seq_aux_loss_coeff": 1e-4}},
}
# What a format cannot hold, named in its warnings (model.<path>); everything else comes back equal.
LOST = {("qwen3_moe_mlp_only", "mindformers2"): {"model.moe.aux_loss_coeff", "model.moe.first_dense_layers"},
        **{(f, "mindformers"): {"model.mla", "model.head_dim", "model.moe", "model.moe.aux_loss_coeff",
                                "model.moe.first_dense_layers", "model.mtp_layers", "model.mtp_loss_factor",
                                "model.rope_scaling.mscale_all_dim"} for f in ("deepseek_v3",)},
        ("deepseek_v2", "mindformers"): {"model.mla", "model.head_dim", "model.moe", "model.moe.aux_loss_coeff",
                                         "model.moe.first_dense_layers", "model.rope_scaling.mscale_all_dim"},
        ("qwen3_moe", "mindformers"): {"model.head_dim", "model.moe", "model.qk_norm"},
        ("qwen3_moe_mlp_only", "mindformers"): {"model.moe", "model.moe.first_dense_layers", "model.qk_norm"}}


def _job(model: dict, world: int = 2, **strategy):
    job = job_from_dict({"name": "family", "model": model, "strategy": {"dp": world, "ep": 2, **strategy},
                         "train": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64, "steps": 10}})
    return from_job(job, world)


def _layers_apart(m: ModelConfig) -> tuple:
    """The model with its MoE layer placement as the set of layers (a 0/1 flag per layer reads back in
    the form with the fewest fields, which may spell the same layers otherwise)."""
    if m.moe is None:
        return m, ()
    moe = dataclasses.replace(m.moe, first_dense_layers=0, layer_freq=1, dense_layers=())
    return dataclasses.replace(m, moe=moe), m.moe_layers


@pytest.mark.parametrize("fmt", ["ms_llm", "mindformers2", "megatron", "mindformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_survives_the_format_or_names_each_loss(family, fmt):
    conv = _job(FAMILIES[family])
    out = dump(conv, fmt)
    back = read(out.text, "converted" + SUFFIX[fmt], fmt, ReadOptions(world_size=2))
    named = {w.split(" ")[0].rstrip(":") for w in out.warnings if w.startswith("model")}
    assert named == LOST.get((family, fmt), set())
    lost = {path.split(".")[1] for path in named}
    want = dataclasses.replace(conv.job.model, name=back.job.model.name, dtype=back.job.model.dtype,
                               **{k: getattr(back.job.model, k) for k in lost})
    assert _layers_apart(back.job.model) == _layers_apart(want)


@pytest.mark.parametrize("config", flavors.REGISTERED)
@pytest.mark.parametrize("fmt", ["torchtitan", "torchtitan_toml", "megatron", "mindformers2"])
def test_torchtitan_flavors_survive_or_name_each_loss(config, fmt):
    """A model of a registered torchtitan flavor's shape is written as that config (0.3) or flavor
    (v0.2.x TOML) and read back equal; Megatron and MindFormers name what they cannot hold (the
    expert bias with softmax scores, YaRN's extended context)."""
    module, _, depth = flavors.REGISTERED[config]
    model = {**flavors.model_of(module, config), "name": config}
    conv = _job(model, world=8, zero={"stage": 3})
    out = dump(conv, fmt)
    back = read(out.text, "converted" + SUFFIX[fmt], fmt, ReadOptions(world_size=8))
    named = {w.split(" ")[0].rstrip(":") for w in out.warnings if w.startswith("model")}
    m = conv.job.model
    want = set()
    if fmt in ("megatron", "mindformers2") and m.moe.score_function == "softmax":
        want.add("model.moe.expert_bias")          # both take the expert bias with sigmoid scores only
    if fmt == "mindformers2" and m.mla is not None:
        want.add("model.max_seq_len")              # its YaRN context is max_position_embeddings
    if fmt == "torchtitan_toml" and depth:
        want.add("model.mtp_layers")               # a v0.2.x flavor has no MTP modules
    assert named == want
    lost = {path.split(".")[1] for path in named}
    assert back.job.model == dataclasses.replace(m, name=back.job.model.name, dtype=back.job.model.dtype,
                                                 **{k: getattr(back.job.model, k) for k in lost})


def test_torchtitan_deepseek_v3_671b_reads_as_deepseek_v3():
    toml = '[model]\nname = "deepseek_v3"\nflavor = "671B"\n[parallelism]\ndata_parallel_shard_degree = 64\n' \
           'expert_parallel_degree = 64\n[training]\nlocal_batch_size = 1\nseq_len = 4096\n'
    m = read(toml, "dsv3.toml", "torchtitan").job.model
    assert (m.mla, m.moe.num_groups, m.moe.group_top_k, m.moe.routed_scaling_factor) == (MLA_V3, 8, 4, 2.5)
    assert (round(m.num_params(mtp=False) / 1e9, 1), m.rope_scaling.type, m.rope_scaling.mscale_all_dim) == \
        (671.0, "yarn", 1.0)
    job = "torchrun --nproc_per_node=8 -m torchtitan.train --module deepseek_v3 --config deepseek_v3_debugmodel_mtp " \
          "--parallelism.data_parallel_shard_degree 8\n"
    m = read(job, "dsv3.sh", "torchtitan").job.model
    assert (m.mtp_layers, m.mtp_loss_factor, m.mla.q_lora_rank, m.moe.normalize_top_k) == (1, 0.3, None, False)


@pytest.mark.parametrize("etp,want", [(None, 1), (1, 1), (8, 8)])
def test_torchtitan_expert_parallel_keeps_experts_whole(etp, want):
    """torchtitan 0.3 keeps experts whole under ep, borrowing dp_shard x cp x tp ranks (its sparse mesh
    efsdp x ep): ms_llm's etp 1. v0.2.x's expert_tensor_parallel_degree (default 1) may be tp, which
    splits them like the dense MLP: etp = tp. 0.3 has no such field, so an etp = tp job is written
    with whole experts and a warning that says so."""
    toml = '[model]\nname = "deepseek_v3"\nflavor = "671B"\n[parallelism]\ndata_parallel_shard_degree = 8\n' \
           'tensor_parallel_degree = 8\nexpert_parallel_degree = 8\n' \
           + (f'expert_tensor_parallel_degree = {etp}\n' if etp else '') \
           + '[training]\nlocal_batch_size = 1\nseq_len = 4096\n'
    conv = read(toml, "dsv3.toml", "torchtitan")
    s = conv.job.strategy
    assert (s.ep, s.expert_tp, s.edp) == (8, want, 64 // 8 // want)
    written = dump(conv, "torchtitan")                  # torchtitan 0.3's job script for its registered config
    assert "expert_tensor_parallel" not in written.text
    assert read(written.text, "job.sh", "torchtitan").job.strategy.expert_tp == 1
    lost = [w for w in written.warnings if w.startswith("strategy.etp")]
    assert lost == ([] if want == 1 else ["strategy.etp = -1: torchtitan keeps experts whole under expert parallel "
                                          "(ep borrows the tp ranks, ms_llm's etp 1); written so"])


# ---- Megatron-LM arguments as DeepSeek-V3's recipes write them ------------------------------------------

DEEPSEEK_V3_ARGS = (
    "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --swiglu "
    "--normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 "
    "--position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights "
    "--vocab-size 129280 --make-vocab-size-divisible-by 1 --seq-length 4096 --max-position-embeddings 163840 "
    "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
    "--v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 "
    "--num-experts 256 --moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-score-function sigmoid "
    "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 8 --moe-router-group-topk 4 "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 --decoder-last-pipeline-num-layers 1 "
    "--expert-model-parallel-size 64 "
    "--micro-batch-size 1 --global-batch-size 15360 --bf16 --use-distributed-optimizer ")


def test_megatron_deepseek_v3_arguments():
    conv = read(DEEPSEEK_V3_ARGS, "dsv3.args", "megatron", ReadOptions(world_size=2048))
    m = conv.job.model
    assert (m.mla, m.mtp_layers, m.mtp_loss_factor) == (MLA_V3, 1, 0.1)
    assert m.rope_scaling == RopeScaling(type="yarn", factor=40.0, original_max_seq_len=4096, mscale=1.0,
                                         mscale_all_dim=1.0)         # MLATransformerConfig's context and betas
    assert m.moe == MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden_size=2048, shared_experts=1,
                              first_dense_layers=3, score_function="sigmoid", routed_scaling_factor=2.5, num_groups=8,
                              group_top_k=4, expert_bias=True, aux_loss_coeff=0.0, seq_aux_loss_coeff=1e-4)
    assert round(m.num_params(mtp=False) / 1e9, 1) == 671.0 and conv.warnings == []
    out = dump(conv, "megatron")
    assert out.warnings == [] and read(out.text, "dsv3.sh", "megatron").job.model == m


@pytest.mark.parametrize("change,model,warned", [
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 1e-4",
     {"aux_loss_coeff": 1e-2, "seq_aux_loss_coeff": 1e-4}, None),
    ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-3", {"aux_loss_coeff": 1e-3},
     "global_aux_loss (over the global batch) is not expressible"),
    ("--moe-router-score-function softmax --moe-router-pre-softmax --moe-aux-loss-coeff 1e-3",
     {"score_function": "softmax", "normalize_top_k": False, "expert_bias": False, "aux_loss_coeff": 1e-3}, None),
])
def test_megatron_balance_losses_and_scores(change, model, warned):
    args = DEEPSEEK_V3_ARGS.replace("--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 ", "")
    if "softmax" in change:
        args = args.replace("--moe-router-score-function sigmoid ", "").replace("--moe-router-enable-expert-bias ", "")
    conv = read(args + change, "dsv3.args", "megatron", ReadOptions(world_size=2048))
    assert {k: getattr(conv.job.model.moe, k) for k in model} == model
    assert any(warned in w for w in conv.warnings) if warned else conv.warnings == []
    back = read(dump(conv, "megatron").text, "back.sh", "megatron")
    assert back.job.model.moe == conv.job.model.moe


@pytest.mark.parametrize("change,message", [
    (("--moe-router-score-function sigmoid ", ""), "--moe-router-enable-expert-bias: needs --moe-router-score-function"),
    (("--moe-aux-loss-coeff 1e-4", "--moe-aux-loss-coeff 1e-4 1e-2"), "one coefficient each"),
])
def test_megatron_refusals_name_the_flag(change, message):
    with pytest.raises(ConversionError, match=message):
        read(DEEPSEEK_V3_ARGS.replace(*change), "dsv3.args", "megatron", ReadOptions(world_size=2048))


def test_megatron_mla_without_latent_norms_is_named():
    conv = read(DEEPSEEK_V3_ARGS.replace("--qk-layernorm ", ""), "dsv3.args", "megatron", ReadOptions(world_size=2048))
    assert conv.job.model.mla == MLA_V3
    assert [w for w in conv.warnings] == [next(w for w in conv.warnings if "without --qk-layernorm" in w)]
