"""MindFormers YAML -> IR: degrees, parallel optimizer, MindFormers' global-batch and FFN rules."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from ms_llm.config.model import MoEConfig
from ms_llm.convert import ConversionError, ReadOptions, dump, from_job, load, read
from ms_llm.convert.mindformers.read import mindformers_ffn
from ms_llm.errors import ConfigError
from ms_llm.job import load_job, load_section

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "configs" / "examples"    # the peers' configs users convert
SEVEN_B = (FIXTURES / "mindformers_r1_llama2_7b.yaml").read_text()
# the 7B recipe on dp2 * mp2 * cp2 with use_seq_parallel (flash attention on, as the recipe has it)
CP2_SP = SEVEN_B.replace("  data_parallel: 8", "  data_parallel: 2") \
    .replace("  model_parallel: 1", "  model_parallel: 2\n  context_parallel: 2") \
    .replace("  use_seq_parallel: False", "  use_seq_parallel: True")


def test_llama2_7b_pretrain():
    conv = load(FIXTURES / "mindformers_r1_llama2_7b.yaml")
    job = conv.job
    m, s, t = job.model, job.strategy, job.train
    assert (job.device, job.backend, conv.world_size) == ("910b", "mindspore", 8)
    assert (s.dp, s.tp, s.pp, s.zero.stage) == (8, 1, 1, 1)           # enable_parallel_optimizer
    assert (t.global_batch_size, t.micro_batch_size) == (64, 1)       # batch 1 * dp 8 * accumulation 8
    assert (m.name, m.ffn_hidden_size, m.num_kv_heads, m.vocab_size) == ("llama2_7b", 11008, 32, 32000)
    assert (s.precision.param_dtype, s.precision.master_dtype, s.precision.loss_scale) == \
        ("float16", "float16", "dynamic")                              # param_init_type float16, no fp32 copy
    assert s.precision.initial_loss_scale == 65536
    assert (t.seed, t.optimizer.lr, t.optimizer.beta2, t.optimizer.weight_decay) == (0, 5e-5, 0.95, 0.0)
    assert t.optimizer.grad_clip == 1.0 and t.checkpoint.interval == 100 and not t.checkpoint.async_save
    text = "\n".join(conv.warnings)
    assert "train_dataset: section not modelled" in text and "max_device_memory = '58GB'" in text
    assert "ObsMonitor" in text and "warmup_ratio" in text


def test_llama2_70b_pretrain():
    conv = load(FIXTURES / "mindformers_r1_llama2_70b.yaml")
    m, s, t = conv.job.model, conv.job.strategy, conv.job.train
    assert conv.world_size == 64                                       # 2*4*8, whatever the comment says
    assert (s.dp, s.tp, s.pp, s.sequence_parallel, s.zero.stage) == (2, 4, 8, True, 1)
    assert (t.global_batch_size, t.micro_batch_size) == (256, 1)      # batch 1 * dp 2 * micro_batch_num 128
    assert m.ffn_hidden_size == 28672 and m.num_kv_heads == 8         # ffn_dim_multiplier 1.3, multiple_of 256
    assert t.checkpoint.interval == 1000                               # CheckpointMointor, MindFormers' alias


def test_mindformers_ffn_rule_differs_from_meta():
    assert mindformers_ffn(8192, 256, 1.3) == 28672                   # multiplier (+0.01) before the 2/3
    assert mindformers_ffn(4096, 256, None) == 11008
    assert mindformers_ffn(5120, 256, None) == 13824


def test_gradient_accumulation_is_ignored_under_pipeline_parallel():
    text = (FIXTURES / "mindformers_r1_llama2_70b.yaml").read_text().replace(
        "gradient_accumulation_steps: 1", "gradient_accumulation_steps: 4")
    conv = read(text, "70b.yaml")
    assert conv.job.train.global_batch_size == 256
    assert any("ignored under pipeline parallel" in w for w in conv.warnings)


def test_interleave_offsets_recompute_and_shard_size():
    text = SEVEN_B.replace("  pipeline_stage: 1", "  pipeline_stage: 4") \
        .replace("  data_parallel: 8", "  data_parallel: 2") \
        .replace("  micro_batch_num: 1", "  micro_batch_num: 8").replace("    offset: 0", "    offset: [1, -1, 0, 0]") \
        .replace("  recompute: False", "  recompute: [2, 2, 2, 2]") \
        .replace("    gradient_accumulation_shard: False", "    gradient_accumulation_shard: True\n"
                                                             "    optimizer_weight_shard_size: 1")
    conv = read(text, "7b_pp4.yaml")
    s = conv.job.strategy
    assert (s.pp, s.pipeline.layer_split, s.recompute.num_layers, s.zero.stage, s.zero.shard_size) == \
        (4, (9, 7, 8, 8), 2, 2, 1)
    assert conv.job.train.global_batch_size == 16


@pytest.mark.parametrize("change,message", [
    (("  data_parallel: 8", "  data_parallel: 4"), "--world-size 8"),
    (("  model_parallel: 1", "  model_parallel: 2\n  context_parallel: 2"), "use_flash_attention"),
    (("parallel_mode: 1", "parallel_mode: 0"), "parallel.full_batch: must be False in data_parallel mode"),
    (("parallel_mode: 1", "parallel_mode: 0\n  full_batch: False"), None),
    (("parallel_mode: 1", "parallel_mode: 7"), "parallel.parallel_mode: got 7"),
    (("    hidden_size: 4096", "    hidden_size: many"), "model.model_config.hidden_size: got 'many'"),
    (("    offset: 0", "    offset: [1, 2]"), None),
])
def test_contradictions_name_the_key(change, message):
    old, new = change
    text = SEVEN_B.replace(old, new)
    if "full_batch: False" in new:
        text = text.replace("  full_batch: True\n", "")
    if "context_parallel" in new:
        text = text.replace("use_flash_attention: True", "use_flash_attention: False")
    options = ReadOptions(world_size=8) if message == "--world-size 8" else ReadOptions()
    if message is None:
        read(text, "7b.yaml")                 # data_parallel mode done right, or offsets without pp: fine
        return
    with pytest.raises(ConversionError, match=message):
        read(text, "7b.yaml", options=options)


def test_data_parallel_mode_refuses_model_parallel():
    text = SEVEN_B.replace("parallel_mode: 1", "parallel_mode: 0") \
        .replace("  model_parallel: 1", "  model_parallel: 2") \
        .replace("  data_parallel: 8", "  data_parallel: 4")
    with pytest.raises(ConversionError, match="7b.yaml: parallel.parallel_mode: data_parallel"):
        read(text, "7b.yaml")


def test_not_yaml():
    with pytest.raises(ConfigError, match="bad.yaml: line 3 not valid YAML"):
        read("parallel_config:\n  data_parallel: [1,\n", "bad.yaml", "mindformers")


def test_use_seq_parallel_with_context_parallel_is_sequence_parallel():
    """MindFormers' LLaMA applies use_seq_parallel with cp > 1 too: its residual add is (dp, cp*mp, 1)."""
    conv = read(CP2_SP, "7b_cp2_sp.yaml")
    s = conv.job.strategy
    assert (s.dp, s.tp, s.cp, s.sequence_parallel) == (2, 2, 2, True)
    assert not any("use_seq_parallel" in w for w in conv.warnings)
    assert conv.sources["strategy.sequence_parallel"] == "parallel_config.use_seq_parallel"


def test_use_seq_parallel_without_model_parallel_is_off():
    conv = read(SEVEN_B.replace("  use_seq_parallel: False", "  use_seq_parallel: True"), "7b_sp.yaml")
    assert conv.job.strategy.sequence_parallel is False
    assert any("use_seq_parallel is a no-op in MindFormers when model_parallel = 1" in w for w in conv.warnings)


@pytest.mark.parametrize("line,flash", [("use_flash_attention: True", True), ("use_flash_attention: False", False),
                                        ("", False)])       # MindFormers' LlamaConfig default is False
def test_use_flash_attention_is_model_flash_attention(line, flash):
    text = SEVEN_B.replace("use_flash_attention: True # FA can accelerate training or finetune", line)
    conv = read(text, "7b.yaml")
    assert conv.job.model.flash_attention is flash
    assert not any("use_flash_attention" in w for w in conv.warnings)      # read, not dropped


def _written(job, world: int) -> tuple[dict, list[str]]:
    out = dump(from_job(job, world), "mindformers")
    return yaml.safe_load(out.text), out.warnings


@pytest.mark.parametrize("flash", [True, False])
def test_flash_attention_is_written_as_use_flash_attention(flash):
    job = read(SEVEN_B, "7b.yaml").job
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, flash_attention=flash))
    mf, warnings = _written(job, 8)
    assert mf["model"]["model_config"]["use_flash_attention"] is flash
    assert not any("flash_attention" in w for w in warnings)


def test_context_parallel_writes_flash_attention_and_says_so():
    job = read(CP2_SP, "7b_cp2_sp.yaml").job
    plain = dataclasses.replace(job, model=dataclasses.replace(job.model, flash_attention=False))
    mf, warnings = _written(plain, 8)
    assert mf["model"]["model_config"]["use_flash_attention"] is True
    assert mf["parallel_config"]["use_seq_parallel"] is True and mf["parallel_config"]["context_parallel"] == 2
    assert any(w.startswith("model.flash_attention = False: MindFormers runs context parallel") for w in warnings)
    _, warnings = _written(job, 8)                                # flash already on: nothing to say
    assert not any("flash_attention" in w for w in warnings)


def test_cp2_sequence_parallel_flash_survives_the_round_trip():
    conv = read(CP2_SP, "7b_cp2_sp.yaml")
    back = read(dump(conv, "mindformers").text, "back.yaml", "mindformers")
    s, m = back.job.strategy, back.job.model
    assert (s.cp, s.tp, s.sequence_parallel, m.flash_attention) == (2, 2, True, True)


# ---- MindFormers 2.x: every pretraining config shipped in the mindformers 2.1.0 package ----------

SHIPPED = Path(__file__).resolve().parents[2] / ".oracles" / "configs"
PRETRAIN = sorted(SHIPPED.glob("*/*pretrain*.yaml"))
# what the command line adds: the pynative layout's data_parallel_shard = -1 needs the device count,
# the general templates keep the model shape in a Hugging Face folder (pretrained_model_dir)
SHIPPED_OPTIONS = {"pretrain_deepseek3_1b_8p_pynative": ReadOptions(world_size=8),
                   "pretrain_deepseek4_flash": ReadOptions(world_size=8),
                   "pretrain_deepseek4_flash_reduction": ReadOptions(world_size=8),
                   "pretrain_deepseek4_pro": ReadOptions(world_size=8),
                   "pretrain_deepseek4_pro_reduction": ReadOptions(world_size=8)}
# MindFormers' own LayerSetting refuses the first: 45 layers over 8 stages with offset 0; DeepSeek-V4's
# attention (compressed sparse attention, grouped low-rank output, hyper-connections) has no ms_llm form.
DSV4 = "model.experimental_attention_variant: 'dsv4_hybrid'"
REFUSED = {"pretrain_telechat3_105b_a4b_4k": "model.model_config.offset: 0, but 45 layers over 8 pipeline chunks",
           "pretrain_deepseek4_flash": DSV4, "pretrain_deepseek4_flash_reduction": DSV4,
           "pretrain_deepseek4_pro": DSV4, "pretrain_deepseek4_pro_reduction": DSV4}


def _shipped_options(path: Path) -> ReadOptions:
    if path.stem.startswith("llm_pretrain"):
        from ms_llm.job import load_section
        return ReadOptions(model=load_section("model", "llama2_7b"))
    return SHIPPED_OPTIONS.get(path.stem, ReadOptions())


def test_the_shipped_configs_are_there():
    assert len(PRETRAIN) == 13, f"mindformers 2.1.0 ships 13 pretrain configs; .oracles/configs has {len(PRETRAIN)} " \
                                "(run `make oracles`)"


@pytest.mark.parametrize("path", PRETRAIN, ids=[p.stem for p in PRETRAIN])
def test_every_shipped_pretrain_config_converts_or_names_the_key(path):
    if path.stem in REFUSED:
        with pytest.raises(ConversionError, match=REFUSED[path.stem]):
            load(path, "mindformers", _shipped_options(path))
        return
    conv = load(path, "mindformers", _shipped_options(path))
    # each layout keeps every model field it does not warn about
    for fmt in ("mindformers", "mindformers2"):
        out = dump(conv, fmt)
        back = read(out.text, "back.yaml", "mindformers")
        lost = {w.split(" ")[0].rstrip(":").split(".")[1] for w in out.warnings if w.startswith("model.")}
        expected = dataclasses.replace(conv.job.model, name=back.job.model.name,
                                       **{k: getattr(back.job.model, k) for k in lost})
        assert back.job.strategy == conv.job.strategy and back.job.model == expected, (fmt, lost)
    for w in conv.warnings:                      # every warning names the key it is about
        assert w.split(" ")[0].rstrip(":").split("[")[0].replace("_", "").replace(".", "").isalnum(), w


def test_qwen3_32b_2x_layout():
    conv = load(SHIPPED / "qwen3" / "pretrain_qwen3_32b_4k.yaml", "mindformers")
    m, s, t = conv.job.model, conv.job.strategy, conv.job.train
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.rope_theta, m.norm_eps) == \
        (64, 64, 8, 25600, 1e6, 1e-6)
    assert (s.dp, s.tp, s.pp, s.pipeline.layer_split, s.recompute.policy) == (1, 4, 4, (15, 15, 17, 17), "full")
    assert (s.precision.param_dtype, s.precision.master_dtype) == ("bfloat16", "float32")      # params_dtype float32
    assert t.data.paths == ("/path/to/wiki103-megatron_text_document",) and t.data.split == "1,0,0"
    assert (t.global_batch_size, t.steps) == (4, 4000)            # 8000 samples / (1 * dp 1 * 4 micro) * 2 epochs
    text = "\n".join(conv.warnings)
    assert (m.head_dim, m.qk_norm, m.qkv_bias) == (128, True, False)           # 64 heads * 128 > hidden 5120
    assert round(m.num_params() / 1e9, 2) == 32.76                              # Qwen3-32B's count
    assert "head_dim" not in text and "qk_layernorm" not in text
    assert "overrides optimizer.learning_rate" not in text        # 2.x gives the rate in lr_schedule only


def test_qwen3_moe_reads_model_moe_and_names_the_routing_it_cannot_express():
    conv = load(SHIPPED / "qwen3_moe" / "pretrain_qwen3_30b_a3b_4k.yaml", "mindformers")
    m, s = conv.job.model, conv.job.strategy
    assert (m.ffn_hidden_size, s.dp, s.tp, s.ep, s.etp) == (6144, 1, 4, 4, 1)     # ep over the mp ranks, whole experts
    assert m.moe == MoEConfig(num_experts=128, top_k=8, expert_ffn_hidden_size=768, normalize_top_k=False,
                              aux_loss_coeff=0.001, routed_scaling_factor=1.5)
    text = "\n".join(conv.warnings)
    assert "expert_parallel" not in text
    assert "model.model_config.moe_router_load_balancing_type = gbs_aux_loss (the balance loss over the global " \
           "batch): not expressible" in text
    assert "norm_topk_prob" not in text and "router_aux_loss_coef" not in text     # read, or the same value
    assert "routed_scaling_factor" not in text
    assert (m.head_dim, m.qk_norm) == (128, True)                                  # not 2048 / 32 = 64


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parallel_optimizer_level_round_trips_every_zero_stage(stage):
    job = read(SEVEN_B, "7b.yaml").job
    job = dataclasses.replace(job, strategy=dataclasses.replace(
        job.strategy, zero=dataclasses.replace(job.strategy.zero, stage=stage)))
    mf, warnings = _written(job, 8)
    assert mf["parallel"]["parallel_optimizer_config"]["optimizer_level"] == f"level{stage}"
    assert not any("zero" in w for w in warnings)
    assert read(yaml.safe_dump(mf), "back.yaml").job.strategy.zero.stage == stage


def test_gradient_accumulation_shard_is_level2_and_conflicts_name_the_key():
    assert read(SEVEN_B.replace("gradient_accumulation_shard: False", "gradient_accumulation_shard: True"),
                "7b.yaml").job.strategy.zero.stage == 2
    text = SEVEN_B.replace("gradient_accumulation_shard: False",
                           "gradient_accumulation_shard: True\n    optimizer_level: level3")
    with pytest.raises(ConversionError, match="gradient_accumulation_shard: True needs optimizer_level level2"):
        read(text, "7b.yaml")


def test_pynative_layout_needs_the_world_size():
    path = SHIPPED / "deepseek3" / "pretrain_deepseek3_1b_8p_pynative.yaml"
    with pytest.raises(ConversionError, match=r"parallelism.data_parallel_shard: -1 .* --world-size"):
        load(path, "mindformers")
    s = load(path, "mindformers", ReadOptions(world_size=8)).job.strategy
    assert (s.dp, s.ep, s.zero.stage) == (8, 1, 3)                # FSDP-shaped: optim_grads_params
    # DeepSeek-V4's attention has no ms_llm form: its parallel layout converts with a model given
    flash = SHIPPED / "deepseek4" / "pretrain_deepseek4_flash.yaml"
    s = load(flash, "mindformers", ReadOptions(world_size=8, model=load_section("model", "mixtral_8x7b"))).job.strategy
    assert (s.dp, s.ep, s.zero.stage) == (8, 8, 3)                # expert_parallel 8


def test_qwen_math_in_both_layouts():
    """q/k/v biases and rope scaling in r1.x (qkv_has_bias, extend_method) and 2.x (add_qkv_bias,
    attention_bias, Hugging Face's rope_scaling); 2.x names Qwen3ForCausalLM when q and k are normed."""
    base = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 32, "attention_bias": True,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    two = read(yaml.safe_dump({"use_legacy": False, "model": {"model_config": base}}), "q.yaml", "mindformers")
    m = two.job.model
    assert (m.head_dim, m.qkv_bias, m.qk_norm, m.rope_scaling.type, m.rope_scaling.factor) == \
        (32, True, False, "yarn", 4)
    r1 = read(dump(two, "mindformers").text, "r1.yaml", "mindformers").job.model
    assert (r1.qkv_bias, r1.rope_scaling) == (True, m.rope_scaling)                # YARN's mscale keys carry it
    assert "extend_method: YARN" in dump(two, "mindformers").text
    normed = read(yaml.safe_dump({"use_legacy": False, "model": {"model_config": {**base, "qk_layernorm": True}}}),
                  "q3.yaml", "mindformers")
    out = dump(normed, "mindformers2")
    assert "Qwen3ForCausalLM" in out.text and read(out.text, "b.yaml", "mindformers").job.model.qk_norm
    assert any(w.startswith("model.rope_scaling.type = yarn") for w in out.warnings)   # 2.x trains plain rotary
    llama3 = {"extend_method": "LLAMA3", "scaling_factor": {"factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "qkv_has_bias": True}
    legacy = {"type": "LlamaConfig", "num_layers": 2, "num_heads": 4, "hidden_size": 64, "vocab_size": 256,
              "intermediate_size": 128, "seq_length": 64, "compute_dtype": "bfloat16",
              "param_init_type": "float32", **llama3}
    r = read(yaml.safe_dump({"model": {"model_config": legacy}}), "l.yaml", "mindformers").job.model
    assert (r.rope_scaling.type, r.rope_scaling.original_max_seq_len, r.qkv_bias) == ("llama3", 8192, True)


@pytest.mark.parametrize("change,algorithm,warned", [
    ("", "allgather", False), ("  context_parallel_algo: ulysses_cp\n", "ulysses", False),
    ("  context_parallel_algo: hybrid_cp\n", "allgather", True)])
def test_context_parallel_algo_and_ring_attention(change, algorithm, warned):
    """colossalai_cp (MindFormers' default) gathers K/V, ulysses_cp is Ulysses, use_ring_attention
    passes K/V around a ring; hybrid_cp has no IR name and is named."""
    conv = read(CP2_SP.replace("  context_parallel: 2\n", "  context_parallel: 2\n" + change), "cp.yaml")
    assert conv.job.strategy.context_parallel.algorithm == algorithm
    assert any("context_parallel_algo" in w for w in conv.warnings) is warned
    flash = "    use_flash_attention: True"
    ring = CP2_SP.replace(flash, flash + "\n    use_ring_attention: True")
    assert read(ring, "ring.yaml").job.strategy.context_parallel.algorithm == "ring"
    with pytest.raises(ConversionError, match="use_ring_attention: ring attention runs with context_parallel_algo "
                                              "colossalai_cp, not ulysses_cp"):
        read(ring.replace("  context_parallel: 2\n", "  context_parallel: 2\n  context_parallel_algo: ulysses_cp\n"),
             "ring.yaml")


# r1.x LLaMA with MindSpore's MoEConfig (MoEV2), on dp 2 x mp 2 (the MindFormers oracle's model, small)
MOE_R1 = {"model": {"model_config": {"num_layers": 2, "hidden_size": 256, "num_heads": 8, "vocab_size": 512,
                                     "seq_length": 64, "intermediate_size": 512, "compute_dtype": "float32",
                                     "param_init_type": "float32",
                                     "moe_config": {"expert_num": 4, "num_experts_chosen": 2, "capacity_factor": 1.5,
                                                    "routing_policy": "TopkRouterV2"}}},
          "runner_config": {"batch_size": 1}}


def _moe_r1(ep: int, expert_model_parallel=None, mcore: bool = False) -> str:
    data = yaml.safe_load(yaml.safe_dump(MOE_R1))
    data["parallel_config"] = {"data_parallel": 2, "model_parallel": 2, "expert_parallel": ep}
    if expert_model_parallel is not None:
        data["model"]["model_config"]["moe_config"]["expert_model_parallel"] = expert_model_parallel
    return yaml.safe_dump(data)


@pytest.mark.parametrize("ep, emp, etp, edp", [(2, None, 2, 1), (4, 1, 1, 1), (2, 1, 1, 2), (2, 2, 2, 1)])
def test_r1_expert_model_parallel_is_expert_tensor_parallel(ep, emp, etp, edp):
    """MoEV2 splits each expert over moe_config.expert_model_parallel ranks (unset: model_parallel) and
    carves ep out of dp*mp / that: the IR's etp (-1 when it is model_parallel), folding ep over the
    model-parallel ranks when it is 1. Written back the same."""
    conv = read(_moe_r1(ep, emp), "moe.yaml")
    s = conv.job.strategy
    assert (s.ep, s.expert_tp, s.edp, s.etp) == (ep, etp, edp, -1 if etp == 2 else etp)
    assert not any("expert" in w for w in conv.warnings)
    out = dump(conv, "mindformers")
    assert not any("strategy.e" in w for w in out.warnings)
    written = yaml.safe_load(out.text)
    assert written["model"]["model_config"]["moe_config"].get("expert_model_parallel") == (1 if etp == 1 else None)
    assert read(out.text, "back.yaml").job.strategy == s


def test_r1_expert_model_parallel_takes_1_or_model_parallel():
    with pytest.raises(ConversionError, match=r"moe_config\.expert_model_parallel: got 3; MindFormers takes 1 or "
                                              r"model_parallel = 2"):
        read(_moe_r1(2, 3), "moe.yaml")


def test_2x_experts_are_whole_and_a_split_expert_is_named():
    """MindFormers 2.x trains grouped-GEMM experts, whole on every rank: etp 1 whatever
    parallel_config.expert_model_parallel says (named when it says more); writing a strategy whose
    experts are split names strategy.etp."""
    two = {"use_legacy": False, "parallel_config": {"data_parallel": 2, "model_parallel": 2, "expert_parallel": 4,
                                                    "expert_model_parallel": 2},
           "model": {"model_config": {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
                                      "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
                                      "intermediate_size": 512, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 64, "seq_length": 64}},
           "runner_config": {"batch_size": 1}}
    conv = read(yaml.safe_dump(two), "two.yaml")
    assert (conv.job.strategy.ep, conv.job.strategy.etp) == (4, 1)
    assert any(w.startswith("parallel_config.expert_model_parallel = 2: MindFormers 2.1's grouped-GEMM experts are "
                            "whole") for w in conv.warnings)
    assert not any("strategy.e" in w for w in dump(conv, "mindformers2").warnings)
    split = dataclasses.replace(conv.job, strategy=dataclasses.replace(conv.job.strategy, ep=2, etp=2))
    warnings = dump(from_job(split, 4), "mindformers2").warnings
    assert any(w.startswith("strategy.etp = 2: MindFormers 2.1's grouped-GEMM experts are whole") for w in warnings)


@pytest.mark.parametrize("fmt", ["mindformers", "mindformers2"])
@pytest.mark.parametrize("from_zero", [True, False])
def test_warmup_from_zero_is_read_and_a_later_warmup_is_said(fmt, from_zero):
    """MindFormers' *WithWarmUpLR schedules run update k of the warmup at lr*(k-1)/warmup_steps: read as
    warmup_from_zero, and a job without it is written with a warning that names the field."""
    job = load_job(ROOT / "configs" / "train" / "tiny_ms_dp2.yaml")                          # warmup 5
    job = dataclasses.replace(job, train=dataclasses.replace(
        job.train, schedule=dataclasses.replace(job.train.schedule, warmup_from_zero=from_zero)))
    out = dump(from_job(job, job.strategy.dp), fmt)
    said = [w for w in out.warnings if "train.schedule.warmup_from_zero" in w]
    assert len(said) == (0 if from_zero else 1) and all("warmup starts at 0" in w for w in said)
    back = read(out.text, "out.yaml", fmt, ReadOptions(world_size=job.strategy.dp, model=job.model))
    assert back.job.train.schedule.warmup_from_zero and back.job.train.schedule.warmup_steps == 5
