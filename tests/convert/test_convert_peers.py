"""What convert-strategy writes is read by the peers' own config code, in two subprocesses
(PYTHONPATH=.oracles): megatron-core 0.16.1, deepspeed 0.19.8 and torchtitan 0.3.0 in one (they share
torch), mindformers 2.1.0 under msrun:

- Megatron-LM arguments -> megatron-core's TransformerConfig (its __post_init__ checks them);
- DeepSpeed JSON -> DeepSpeedConfig with the job's data-parallel size (the batch triple, ZeRO);
- torchtitan 0.3 jobs -> ConfigManager.parse_args (the registered config, then our overrides);
- MindFormers 2.x YAML -> MindFormerConfig, MindSpore's set_auto_parallel_context, MindFormers'
  TransformerConfig and LayerSetting with the real degrees, and its model built (small models).

Each peer must accept every file and read back the degrees, batch and layer placement we meant.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm.convert import ReadOptions, dump, from_job, load
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.convert.common import moe_pattern
from ms_llm.convert.torchtitan import flavors
from ms_llm.convert.megatron.read import parse_args
from ms_llm.convert.shell import launch_command
from ms_llm.job import job_from_dict, load_job, load_section

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
FIXTURES = Path(__file__).resolve().parents[2] / "configs" / "examples"    # the peers' configs users convert
EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.yaml"))
SOURCES = {"megatron_gpt3_175b.sh": ReadOptions(), "megatron_llama3_8b.sh": ReadOptions(),
           "mindformers_r1_llama2_70b.yaml": ReadOptions(), "torchtitan_llama3_8b.toml": ReadOptions(world_size=64),
           "deepspeed_zero3_offload.json": ReadOptions(model=load_section("model", "llama2_7b"))}


def _jobs() -> dict:
    """Converted jobs: the peer fixtures, the shipped train configs and MindFormers examples."""
    out = {name: load(FIXTURES / name, options=opts) for name, opts in SOURCES.items()}
    for path in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        job = load_job(path)
        out[path.stem] = from_job(job, None if job.strategy.dp > 0 else 1024, str(path))
    out.update({path.stem: load(path) for path in EXAMPLES})
    out["mindformers_qwen3_32b"] = load(ORACLES / "configs" / "qwen3" / "pretrain_qwen3_32b_4k.yaml")
    out["moe_cp_ulysses"] = _moe_cp_job()
    out["deepseek_mla_mtp"] = _deepseek_job()
    flavor = {**flavors.model_of("deepseek_v3", "deepseek_v3_16b"), "name": "deepseek_v3_16b"}
    out["torchtitan_deepseek_v3_16b"] = from_job(job_from_dict(
        {"name": "dsv3_16b", "model": flavor, "strategy": {"dp": 8, "ep": 8, "zero": {"stage": 3}},
         "train": {"global_batch_size": 32, "micro_batch_size": 4, "seq_len": 4096, "steps": 10}}), 8, "dsv3_16b")
    return out


# A DeepSeek-V3 in miniature with every DeepSeek field away from its default: multi-latent attention
# with the query's low-rank path and YaRN, sigmoid routing in groups with the expert bias, both balance
# losses, a dense first layer, one MTP module.
DEEPSEEK = {"mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16},
            "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "shared_experts": 1,
                    "first_dense_layers": 1, "score_function": "sigmoid", "routed_scaling_factor": 2.5,
                    "num_groups": 4, "group_top_k": 2, "expert_bias": True, "bias_update_rate": 1e-4,
                    "aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 1e-4},
            "mtp_layers": 1, "mtp_loss_factor": 0.2, "num_kv_heads": None, "head_dim": None}


def _deepseek_job():
    model = {**vars(load_section("model", "tiny")), **DEEPSEEK, "max_seq_len": 4096,
             "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_seq_len": 4096, "mscale": 1.0,
                              "mscale_all_dim": 1.0}}
    job = job_from_dict({"name": "deepseek", "model": model, "strategy": {"dp": 2, "ep": 2, "tp": 2},
                         "train": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64, "steps": 10}},
                        ROOT / "configs")
    return from_job(job, 4, "deepseek")


def _moe_cp_job():
    """Every model.moe field the peers hold, on a dp2 x cp2 x ep2 Ulysses job."""
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "shared_experts": 2, "normalize_top_k": False,
           "capacity_factor": 1.5, "aux_loss_coeff": 0.02, "z_loss_coeff": 0.001, "layer_freq": 2}
    job = job_from_dict({"name": "moe_cp", "model": {**vars(load_section("model", "tiny")), "moe": moe},
                         "strategy": {"dp": 2, "cp": 2, "ep": 2, "context_parallel": {"algorithm": "ulysses"}},
                         "train": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64, "steps": 10}},
                        ROOT / "configs")
    return from_job(job, 4, "moe_cp")


def _moe_folded_job():
    """Expert parallel folding: ep 4 over dp 2 x tp 2 with whole experts (etp 1)."""
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32}
    job = job_from_dict({"name": "moe_folded", "model": {**vars(load_section("model", "tiny")), "moe": moe},
                         "strategy": {"dp": 2, "tp": 2, "ep": 4, "etp": 1, "sequence_parallel": True},
                         "train": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64, "steps": 10}},
                        ROOT / "configs")
    return from_job(job, 4, "moe_folded")


JOBS = _jobs()
# Megatron-LM writes what the other peers cannot: expert tensor parallel apart from tp.
MEGATRON_JOBS = {**JOBS, "moe_ep_folded_over_tp": _moe_folded_job()}
# Small jobs MindFormers builds: (strategy, world size)
TINY = {"dp2_tp2_pp2_sp_zero3_uneven": ({"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True, "zero": {"stage": 3},
                                         "recompute": {"policy": "full", "num_layers": 1},
                                         "pipeline": {"layer_split": [1, 3]}}, 8),
        "tp2_pp2_vpp2_zero2": ({"dp": 1, "tp": 2, "pp": 2, "zero": {"stage": 2},
                                "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, 4),
        "dp2_cp2_flash_zero1": ({"dp": 2, "cp": 2, "zero": {"stage": 1}}, 4),
        "qwen3_tp2_bias_head_dim": ({"dp": 1, "tp": 2}, 2),
        "qwen3_moe_dp2_cp2_ep2_ring": ({"dp": 2, "cp": 2, "ep": 2, "context_parallel": {"algorithm": "ring"}}, 4),
        "deepseek_dp2_ep2": ({"dp": 2, "ep": 2}, 2)}
# Qwen3's q/k norms, Qwen2's q/k/v biases and a head_dim apart from hidden / heads, on the tiny model.
QWEN = {"qk_norm": True, "qkv_bias": True, "head_dim": 64}
# Fine-grained routed experts, a shared one, capacity, z-loss and raw top-k weights (Qwen3-MoE has q/k norms).
MOE = {"qk_norm": True, "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, "shared_experts": 1,
                                "normalize_top_k": False, "capacity_factor": 1.5, "z_loss_coeff": 0.001}}


def _tiny(name: str):
    strategy, world = TINY[name]
    flash = strategy.get("cp", 1) > 1
    extra = DEEPSEEK if "deepseek" in name else MOE if "moe" in name else QWEN if "qwen" in name else {}
    model = {**vars(load_section("model", "tiny")), "flash_attention": flash, **extra}
    job = job_from_dict({"name": name, "model": model,
                         "device": "910b", "backend": "mindspore", "strategy": strategy,
                         "train": {"global_batch_size": 8, "micro_batch_size": 1, "seq_len": 64, "steps": 10,
                                   "data": {"paths": ["/data/a", "/data/b"], "weights": [0.3, 0.7]}}}, ROOT / "configs")
    return from_job(job, world, name)


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> None:
    if not (ORACLES / "megatron").is_dir():
        pytest.fail(".oracles/ is missing: run `make oracles` (installs the peers beside .venv)")
    env = {**os.environ, "PYTHONPATH": str(ORACLES), "GLOG_v": "3", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])


def _probe(script: str, cases: dict, tmp: Path) -> dict:
    (tmp / "in.json").write_text(json.dumps(cases))
    _run([sys.executable, str(Path(__file__).parents[1] / "helpers" / script), str(tmp / "in.json"), str(tmp / "out.json")], tmp)
    return json.loads((tmp / "out.json").read_text())


# ---- Megatron-LM: megatron-core's TransformerConfig -------------------------------------------------

@pytest.fixture(scope="module")
def torch_peers(tmp_path_factory) -> dict:
    """megatron-core's, DeepSpeed's and torchtitan's answers, one process (torch_peers_config_probe.py)."""
    megatron = {name: parse_args(launch_command(dump(conv, "megatron").text, "out.sh").args, "out.sh")
                for name, conv in MEGATRON_JOBS.items()}
    deepspeed = {name: {"config": json.loads(dump(conv, "deepspeed").text), "dp": conv.job.strategy.dp}
                 for name, conv in JOBS.items()}
    torchtitan = {name: launch_command(dump(conv, "torchtitan").text, "job.sh").args
                  for name, conv in REGISTERED.items()}
    torchtitan.update({f"flavor:{c}": ["--module", module, "--config", c]
                       for c, (module, _, _) in flavors.REGISTERED.items()})
    return _probe("torch_peers_config_probe.py", {"megatron": megatron, "deepspeed": deepspeed,
                                                   "torchtitan": torchtitan}, tmp_path_factory.mktemp("torch_peers"))


# ---- Megatron-LM: megatron-core's TransformerConfig -------------------------------------------------

@pytest.fixture(scope="module")
def megatron(torch_peers) -> dict:
    return torch_peers["megatron"]


@pytest.mark.parametrize("name", MEGATRON_JOBS)
def test_megatron_core_reads_our_arguments(name, megatron):
    result = megatron[name]
    assert "error" not in result, result
    c, s, m = result["ok"], MEGATRON_JOBS[name].job.strategy, MEGATRON_JOBS[name].job.model
    assert (c["tensor_model_parallel_size"], c["pipeline_model_parallel_size"], c["context_parallel_size"]) == \
        (s.tp, s.pp, s.cp)
    assert c["sequence_parallel"] == (s.sequence_parallel and s.tp > 1)
    assert (c["virtual_pipeline_model_parallel_size"] or 1) == s.pipeline.virtual_stages
    assert (c["num_layers"], c["hidden_size"], c["ffn_hidden_size"]) == (m.num_layers, m.hidden_size, m.ffn_hidden_size)
    assert (c["num_query_groups"] or m.num_heads) == m.num_kv_heads
    assert c["add_qkv_bias"] == m.qkv_bias
    assert c["gated_linear_unit"] and not c["add_bias_linear"] and c["normalization"] == "RMSNorm"
    assert c["recompute_granularity"] == {"none": None, "selective": "selective", "full": "full"}[s.recompute.policy]
    assert c["cp_comm_type"] == {"ring": "p2p", "ulysses": "a2a", "allgather": "all_gather"}.get(
        s.context_parallel.algorithm) if s.cp > 1 else c["cp_comm_type"] is None
    assert (c["mtp_num_layers"] or 0) == m.mtp_layers
    if m.mtp_layers:
        assert c["mtp_loss_scaling_factor"] == m.mtp_loss_factor
    if m.mla is None:
        assert (c["kv_channels"], bool(c["qk_layernorm"])) == (m.head_dim, m.qk_norm)
    else:                       # MLATransformerConfig, with the latent norms (qk_layernorm) and DeepSeek's YaRN
        a, r = m.mla, m.rope_scaling
        assert (c["multi_latent_attention"], c["q_lora_rank"], c["kv_lora_rank"], c["qk_head_dim"],
                c["qk_pos_emb_head_dim"], c["v_head_dim"], bool(c["qk_layernorm"])) == \
            (True, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, True)
        assert c["rope_type"] == ("yarn" if r.type == "yarn" else "rope")
        if r.type == "yarn":
            assert (c["rotary_scaling_factor"], c["mscale"], c["mscale_all_dim"], c["original_max_position_embeddings"],
                    c["beta_fast"], c["beta_slow"]) == \
                (r.factor, r.mscale, r.mscale_all_dim, r.original_max_seq_len, r.beta_fast, r.beta_slow)
    if m.moe is not None:
        moe, shared = m.moe, m.moe.shared_experts * m.expert_ffn_size or None
        assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"],
                c["moe_shared_expert_intermediate_size"], not c["moe_router_pre_softmax"], c["moe_z_loss_coeff"] or 0.0,
                c["moe_expert_capacity_factor"] or -1.0, c["expert_model_parallel_size"],
                c["expert_tensor_parallel_size"]) == \
            (moe.num_experts, moe.top_k, m.expert_ffn_size, shared, moe.normalize_top_k, moe.z_loss_coeff,
             moe.capacity_factor, s.ep, s.expert_tp)
        assert c["moe_layer_freq"] == (moe_pattern(m) if moe.first_dense_layers or moe.dense_layers else moe.layer_freq)
        assert (c["moe_router_score_function"], c["moe_router_topk_scaling_factor"] or 1.0,
                c["moe_router_num_groups"] or 1, c["moe_router_group_topk"] or 1,
                bool(c["moe_router_enable_expert_bias"])) == \
            (moe.score_function, moe.routed_scaling_factor, moe.num_groups, moe.group_top_k,
             moe.expert_bias and moe.score_function == "sigmoid")           # Megatron's bias needs sigmoid scores
        if c["moe_router_enable_expert_bias"]:
            assert c["moe_router_bias_update_rate"] == moe.bias_update_rate
        kinds, coeffs = c["moe_router_load_balancing_type"], c["moe_aux_loss_coeff"]
        balance = dict(zip(*([x] if not isinstance(x, list) else x for x in (kinds, coeffs))))
        assert (balance.get("aux_loss", 0.0), balance.get("seq_aux_loss", 0.0)) == \
            (moe.aux_loss_coeff, moe.seq_aux_loss_coeff)


# ---- DeepSpeed: DeepSpeedConfig with the job's data-parallel size ------------------------------------

@pytest.fixture(scope="module")
def deepspeed(torch_peers) -> dict:
    return torch_peers["deepspeed"]


@pytest.mark.parametrize("name", JOBS)
def test_deepspeed_reads_our_json(name, deepspeed):
    result = deepspeed[name]
    assert "error" not in result, result
    c, s, t = result["ok"], JOBS[name].job.strategy, JOBS[name].job.train
    assert (c["world_size"], c["train_batch_size"], c["micro_batch"]) == (s.dp, t.global_batch_size, t.micro_batch_size)
    assert c["gradient_accumulation_steps"] == t.global_batch_size // (t.micro_batch_size * s.dp)
    assert c["zero_stage"] == s.zero.stage and c["gradient_clipping"] == t.optimizer.grad_clip
    assert c["offload_optimizer"] == s.offload.optimizer


# ---- torchtitan 0.3: ConfigManager (the registered config plus our overrides) ----------------------

REGISTERED = {name: conv for name, conv in JOBS.items()
              if any(f"--config {c}" in dump(conv, "torchtitan").text for c in ("llama3_", "qwen3_", "deepseek_v3_"))}


@pytest.fixture(scope="module")
def torchtitan(torch_peers) -> dict:
    """Our jobs, and each DeepSeek-V3 / Qwen3-MoE config ms_llm knows the model args of, as registered."""
    return torch_peers["torchtitan"]


def test_torchtitan_jobs_cover_registered_configs():
    assert {"torchtitan_llama3_8b.toml", "mindformers_qwen3_32b", "torchtitan_deepseek_v3_16b"} <= set(REGISTERED)


@pytest.mark.parametrize("config", flavors.REGISTERED)
def test_torchtitan_builds_the_model_args_we_read(config, torchtitan):
    """flavors.py's model args are the ones torchtitan's own flavor functions pass, and what it holds
    for every flavor (norm eps, tying, the expert bias's rate, MTP, the rotary layout) is what we read."""
    module, flavor, depth = flavors.REGISTERED[config]
    result = torchtitan[f"flavor:{config}"]
    assert "error" not in result, result
    got = result["ok"]["model"]
    assert got["args"] == {k: v for k, v in flavors.FLAVORS[module][flavor].items() if k != "intermediate_size"}
    m, shared = from_dict(ModelConfig, flavors.model_of(module, config), "model"), got["shared"]
    assert (m.norm_eps, m.tie_embeddings, m.moe.expert_bias, m.moe.bias_update_rate, m.mtp_layers) == \
        (shared["norm_eps"], shared["weight_tying"], True, shared["load_balance_coeff"], shared["mtp_layers"])
    assert (m.moe.score_function, m.moe.normalize_top_k, m.moe.routed_scaling_factor) == \
        (shared["score_func"], shared["route_norm"], shared["route_scale"])
    assert (m.moe.num_groups, m.moe.group_top_k) == tuple(g or 1 for g in shared["groups"])
    if depth:
        assert m.mtp_loss_factor == shared["mtp_scale"]
    if m.mla is not None:            # complex rotary = interleaved pairs; YaRN on
        assert (m.mla.rope_interleave, m.rope_scaling.type) == (shared["rope"] == "ComplexRoPE.Config", shared["yarn"])
    else:
        assert (m.qk_norm, shared["rope"]) == (shared["qk_norm"], "CosSinRoPE.Config")


@pytest.mark.parametrize("name", REGISTERED)
def test_torchtitan_config_manager_reads_our_job(name, torchtitan):
    result = torchtitan[name]
    assert "error" not in result, result
    c, conv = result["ok"], REGISTERED[name]
    s, t = conv.job.strategy, conv.job.train
    shard = c["dp_shard"] if c["dp_shard"] > 0 else conv.world_size // (c["dp_replicate"] * s.tp * s.pp * s.cp)
    assert (c["dp_replicate"] * shard, c["tp"], c["pp"], c["cp"]) == (s.dp, s.tp, s.pp, s.cp)
    assert (c["global_batch_size"], c["seq_len"], c["steps"], c["seed"]) == \
        (t.global_batch_size, t.seq_len, t.steps, t.seed)
    assert (c["lr"], c["betas"]) == (t.optimizer.lr, [t.optimizer.beta1, t.optimizer.beta2])
    assert c["activation_checkpoint"] == {"none": "NoneType", "full": "FullAC", "selective": "SelectiveAC"}[
        s.recompute.policy]
    known = flavors.match(conv.job.model, []) if conv.job.model.moe is not None else None
    if known is not None:            # the registered config's model has our model's shape
        module, flavor, _ = flavors.REGISTERED[known[1]]
        assert c["model"]["args"] == {k: v for k, v in flavors.FLAVORS[module][flavor].items()
                                      if k != "intermediate_size"}


# ---- MindFormers 2.x: MindFormerConfig, MindSpore's context, TransformerConfig, LayerSetting, model ----

@pytest.fixture(scope="module")
def mindformers(tmp_path_factory) -> dict:
    """One msrun worker (MindFormers' mcore models need mindspore.communication.init())."""
    tmp = tmp_path_factory.mktemp("mindformers")
    cases = []
    for name in TINY:
        (tmp / f"{name}.yaml").write_text(dump(_tiny(name), "mindformers2").text)
        cases.append({"path": str(tmp / f"{name}.yaml"), "build": True})
    (tmp / "r1.yaml").write_text(dump(_tiny("dp2_tp2_pp2_sp_zero3_uneven"), "mindformers").text)
    cases += [{"path": str(tmp / "r1.yaml"), "build": False}] + [{"path": str(p), "build": False} for p in EXAMPLES]
    cases += [{"path": str(p), "build": False} for p in SHIPPED_MOE.values()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    venv_bin = str(Path(sys.executable).parent)
    _run([str(Path(venv_bin) / "msrun"), "--worker_num=1", "--local_worker_num=1", f"--master_port={port}",
          f"--log_dir={tmp / 'log'}", "--join=True", str(Path(__file__).parents[1] / "helpers" / "ms_mcore_probe.py"),
          json.dumps(cases), str(tmp / "out.json")], tmp, {"PATH": venv_bin + os.pathsep + os.environ["PATH"]})
    result = json.loads((tmp / "out.json").read_text())
    assert result["mindformers"].startswith("2.1."), result["mindformers"]
    return {Path(p).stem: v for p, v in result["yamls"].items()}


def _expected_parameters(m) -> dict:
    """MindFormers' mcore GPTModel parameters for our model: fused qkv (and its bias) and gate/up,
    per-head q/k norms."""
    h, v, f, q, kv = m.hidden_size, m.vocab_size, m.ffn_hidden_size, m.q_dim, m.kv_dim
    out = {"model.embedding.word_embeddings.weight": [v, h], "model.decoder.final_layernorm.weight": [h],
           "model.output_layer.weight": [v, h]}
    for i in range(m.num_layers):
        p = f"model.decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": [h], p + "self_attention.linear_qkv.weight": [q + 2 * kv, h],
                    p + "self_attention.linear_proj.weight": [h, q], p + "pre_mlp_layernorm.weight": [h],
                    p + "mlp.linear_fc1.weight": [2 * f, h], p + "mlp.linear_fc2.weight": [h, f]})
        if m.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = [q + 2 * kv]
        if m.qk_norm:
            out.update({p + "self_attention.q_layernorm.weight": [m.head_dim],
                        p + "self_attention.k_layernorm.weight": [m.head_dim]})
        if m.moe is not None:        # grouped-GEMM experts: gate/up of every expert in weight1, down in weight2
            e, fe, shared = m.moe.num_experts, m.expert_ffn_size, m.moe.shared_experts * m.expert_ffn_size
            del out[p + "mlp.linear_fc1.weight"], out[p + "mlp.linear_fc2.weight"]
            out.update({p + "mlp.router.weight": [e, h], p + "mlp.router.fi_accu": [e],
                        p + "mlp.experts.weight1": [e * h, 2 * fe], p + "mlp.experts.weight2": [e * fe, h],
                        p + "mlp.shared_experts.linear_fc1.weight": [2 * shared, h],
                        p + "mlp.shared_experts.linear_fc2.weight": [h, shared]})
    return out


@pytest.mark.parametrize("name", TINY)
def test_mindformers_builds_the_2x_yaml_we_write(name, mindformers):
    result, conv = mindformers[name], _tiny(name)
    s, m = conv.job.strategy, conv.job.model
    arch = "TrainingDeepseekV3ForCausalLM" if m.mla else "TrainingQwen3MoeForCausalLM" if m.moe else \
        "TrainingQwen3ForCausalLM" if m.qk_norm else "TrainingTeleChat3ForCausalLM"
    assert result["use_legacy"] is False and result["model"] == arch
    assert result["degrees"] == [s.dp, s.tp, s.pp, s.cp]
    algorithm = {"ring": ("colossalai_cp", True), "allgather": ("colossalai_cp", False),
                 "ulysses": ("ulysses_cp", False)}.get(s.context_parallel.algorithm, ("colossalai_cp", False))
    moe = result["moe"]
    assert (moe["context_parallel_algo"], moe["use_ring_attention"]) == algorithm
    if m.moe is not None:           # MindFormers' TransformerConfig holds every model.moe field we write
        shared = m.moe.shared_experts * m.expert_ffn_size or None
        assert (moe["num_moe_experts"], moe["moe_router_topk"], moe["moe_ffn_hidden_size"],
                moe["moe_shared_expert_intermediate_size"], moe["norm_topk_prob"], moe["moe_z_loss_coeff"] or 0.0,
                moe["moe_expert_capacity_factor"] or -1.0, moe["expert_model_parallel_size"]) == \
            (m.moe.num_experts, m.moe.top_k, m.expert_ffn_size, shared, m.moe.normalize_top_k, m.moe.z_loss_coeff,
             m.moe.capacity_factor, s.ep)
        seq = m.moe.seq_aux_loss_coeff > 0
        assert (moe["moe_router_score_function"], moe["moe_router_topk_scaling_factor"], moe["moe_router_num_groups"],
                moe["moe_router_group_topk"], moe["moe_router_enable_expert_bias"], moe["moe_router_load_balancing_type"],
                moe["moe_aux_loss_coeff"]) == \
            (m.moe.score_function, m.moe.routed_scaling_factor, m.moe.num_groups, m.moe.group_top_k, m.moe.expert_bias,
             "seq_aux_loss" if seq else "sub_seq_aux_loss", m.moe.seq_aux_loss_coeff if seq else m.moe.aux_loss_coeff)
    chunks = s.pp * s.pipeline.virtual_stages
    split = list(s.pipeline.layer_split or [m.num_layers // chunks] * chunks)
    assert result["layers_per_stage"] == [split[v * s.pp:(v + 1) * s.pp] for v in range(s.pipeline.virtual_stages)]
    if m.mla is None:
        assert result["parameters"] == _expected_parameters(m)
        return
    # DeepseekV3: its MLA, MTP and MoE layers, every trained tensor counted (the router's load and bias
    # buffers aside) equal to ms_llm's count with the MTP module
    a = m.mla
    assert (moe["multi_latent_attention"], moe["q_lora_rank"], moe["kv_lora_rank"], moe["qk_head_dim"],
            moe["qk_pos_emb_head_dim"], moe["v_head_dim"], moe["qk_layernorm"], moe["first_k_dense_replace"],
            moe["mtp_num_layers"], moe["mtp_loss_scaling_factor"], moe["moe_router_bias_update_rate"]) == \
        (True, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, True,
         m.moe.first_dense_layers, m.mtp_layers, m.mtp_loss_factor, m.moe.bias_update_rate)
    trained = {k: v for k, v in result["parameters"].items() if not k.endswith(("expert_bias", "expert_load", "fi_accu"))}
    assert sum(math.prod(shape) for shape in trained.values()) == m.num_params(mtp=True)
    assert sum(k.startswith("model.mtp.") for k in trained) and f"model.decoder.layers.{m.num_layers - 1}.mlp.router." \
        "weight" in trained and "model.decoder.layers.0.mlp.linear_fc1.weight" in trained     # a dense first layer


SHIPPED_MOE = {p.stem: p for p in (ORACLES / "configs" / "deepseek3" / "pretrain_deepseek3_671b.yaml",
                                   ORACLES / "configs" / "deepseek3" / "pretrain_deepseek3_12b_16p_pp16.yaml",
                                   ORACLES / "configs" / "qwen3_moe" / "pretrain_qwen3_30b_a3b_4k.yaml")}


@pytest.mark.parametrize("stem", SHIPPED_MOE)
def test_mindformers_reads_its_own_moe_configs_as_we_do(stem, mindformers):
    """MindFormers' TransformerConfig of its shipped DeepSeek-V3 / Qwen3-MoE configs (class defaults
    filled in) holds the multi-latent attention, routing, balance loss and MTP we read."""
    got, m = mindformers[stem]["moe"], load(SHIPPED_MOE[stem], "mindformers").job.model
    moe = m.moe
    assert (got["num_moe_experts"], got["moe_router_topk"], got["moe_ffn_hidden_size"],
            got["moe_shared_expert_intermediate_size"] or 0, got["norm_topk_prob"], got["moe_router_score_function"],
            got["moe_router_topk_scaling_factor"], got["moe_router_num_groups"] or 1, got["moe_router_group_topk"] or 1,
            got["moe_router_enable_expert_bias"], got["moe_router_bias_update_rate"]) == \
        (moe.num_experts, moe.top_k, m.expert_ffn_size, moe.shared_experts * m.expert_ffn_size, moe.normalize_top_k,
         moe.score_function, moe.routed_scaling_factor, moe.num_groups, moe.group_top_k, moe.expert_bias,
         moe.bias_update_rate)
    assert got["moe_layer_freq"] == (moe_pattern(m) if isinstance(got["moe_layer_freq"], list) else moe.layer_freq)
    seq = got["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert got["moe_aux_loss_coeff"] == (moe.seq_aux_loss_coeff if seq else moe.aux_loss_coeff)
    assert (got["mtp_num_layers"], got["mtp_loss_scaling_factor"] if m.mtp_layers else None) == \
        (m.mtp_layers, m.mtp_loss_factor if m.mtp_layers else None)
    if not got["multi_latent_attention"]:
        assert m.mla is None
        return
    a, r = m.mla, m.rope_scaling
    assert (got["q_lora_rank"], got["kv_lora_rank"], got["qk_head_dim"], got["qk_pos_emb_head_dim"],
            got["v_head_dim"], got["qk_layernorm"]) == \
        (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, True)
    if got["position_embedding_type"] == "yarn":
        assert (r.type, r.factor, r.mscale_all_dim) == ("yarn", got["rotary_scaling_factor"], got["mscale"])
    else:                # plain rotary; its softmax still takes m(rotary_scaling_factor, mscale)^2, which we name
        assert r.type == "default" and (got["rotary_scaling_factor"], got["mscale"]) == (40.0, 0.707)


def test_mindformers_loads_the_examples_and_the_r1_layout(mindformers):
    assert mindformers["r1"]["use_legacy"] is True
    assert mindformers["mindformers_r1_llama2_7b"]["use_legacy"] is True
    two = mindformers["mindformers2_llama2_7b"]
    assert (two["use_legacy"], two["degrees"], two["layers_per_stage"]) == (False, [2, 2, 2, 1], [[15, 17]])
