"""Hugging Face config.json <-> ModelConfig for LLaMA, Qwen2, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3
(multi-latent attention, DeepSeekMoE routing, multi-token prediction), both ways.

Import reads every field that changes the math, in both the transformers 4 spelling
(`rope_theta`, `rope_scaling`, `torch_dtype`) and the transformers 5 one (`rope_parameters`,
`dtype`), and refuses, naming the field and value, what the model does not compute exactly as
transformers does (biases on o_proj / the MLP, sliding windows, partial rotary, other rope types,
another activation, dropout). A field left out takes the transformers class default. Export
writes the transformers 5 spelling.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from ms_llm.config.model import MAX_LAYERS, ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.errors import CheckpointError, MsLlmError

MIXTRAL, QWEN3_MOE, DEEPSEEK_V3 = "mixtral", "qwen3_moe", "deepseek_v3"          # config.json model_type
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 MIXTRAL: "MixtralForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM",
                 DEEPSEEK_V3: "DeepseekV3ForCausalLM"}
IMPORTABLE = tuple(ARCHITECTURES)
DEEPSEEK_LATENT_EPS = 1e-6        # transformers' DeepseekV3Attention: RMSNorm's default for q_a / kv_a_layernorm
# Fields whose transformers default differs between the classes.
CLASS_DEFAULTS = {"llama": {"max_position_embeddings": 2048, "head_dim": None, "num_key_value_heads": None},
                  "qwen2": {"max_position_embeddings": 32768, "head_dim": None, "num_key_value_heads": 32},
                  "qwen3": {"max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32},
                  MIXTRAL: {"max_position_embeddings": 131072, "head_dim": None, "num_key_value_heads": 8,
                            "rope_theta": 1e6},
                  QWEN3_MOE: {"max_position_embeddings": 32768, "head_dim": None, "num_key_value_heads": 4},
                  DEEPSEEK_V3: {"max_position_embeddings": 4096, "head_dim": None, "num_key_value_heads": None}}
DTYPES = ("float32", "bfloat16", "float16")
ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "mscale", "mscale_all_dim", "truncate")}
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("original_max_position_embeddings",),
                 "llama3": ROPE_KEYS["llama3"]}
RENAMES = {"original_max_position_embeddings": "original_max_seq_len"}     # theirs -> RopeScaling's


def model_type_of(model: ModelConfig) -> str:
    """The transformers class that computes `model`, or CheckpointError naming what none has."""
    if model.mla is not None:
        _check_deepseek_v3(model)
        return DEEPSEEK_V3
    if model.moe is not None:
        return _moe_type(model)
    if model.qk_norm and model.qkv_bias:
        raise CheckpointError("model: qk_norm with qkv_bias has no transformers class (Qwen3's attention_bias "
                              "also biases o_proj); export covers LLaMA, Qwen2 (qkv_bias) and Qwen3 (qk_norm)")
    if model.qkv_bias and model.head_dim * model.num_heads != model.hidden_size:
        raise CheckpointError(f"model.head_dim: {model.head_dim} x {model.num_heads} heads != hidden_size "
                              f"{model.hidden_size}; Qwen2 derives head_dim from hidden_size")
    return "qwen3" if model.qk_norm else "qwen2" if model.qkv_bias else "llama"


def _moe_type(model: ModelConfig) -> str:
    """Qwen3-MoE (q/k norms) or Mixtral: softmax routers without DeepSeek's bias, groups or scaling."""
    m, kind = model.moe, QWEN3_MOE if model.qk_norm else MIXTRAL
    wrong = [f for f, bad in (("score_function", m.score_function != "softmax"), ("expert_bias", m.expert_bias),
                              ("num_groups", m.num_groups != 1), ("routed_scaling_factor", m.routed_scaling_factor != 1),
                              ("shared_experts", m.shared_experts), ("qkv_bias", model.qkv_bias)) if bad]
    if kind == MIXTRAL and not is_mixtral(model):
        wrong.append("first_dense_layers / layer_freq / dense_layers / normalize_top_k / expert_ffn_hidden_size")
    if wrong:
        raise CheckpointError(f"model.moe: {wrong[0]} has no transformers class without multi-latent attention; "
                              f"export covers Mixtral, Qwen3-MoE (qk_norm) and DeepSeek-V3 (model.mla) models")
    return kind


def _check_deepseek_v3(model: ModelConfig) -> None:
    """What transformers' DeepseekV3ForCausalLM computes: latent norms at 1e-6, sigmoid routing with
    the expert bias buffer, every layer past the leading dense ones MoE, shared experts, each group
    scored by its best 2."""
    if model.norm_eps != DEEPSEEK_LATENT_EPS:
        raise CheckpointError(f"model.norm_eps: {model.norm_eps} is not {DEEPSEEK_LATENT_EPS}, the epsilon "
                              "DeepseekV3ForCausalLM normalises the q/kv latents with whatever rms_norm_eps says; "
                              f"train multi-latent attention models with norm_eps {DEEPSEEK_LATENT_EPS} to export them")
    m = model.moe
    if m is None:
        return
    wrong = [(f, why) for f, bad, why in (
        ("score_function", m.score_function != "sigmoid", "its router scores with a sigmoid"),
        ("layer_freq", m.layer_freq != 1 or any(i >= m.first_dense_layers for i in m.dense_layers),
         "every layer from first_k_dense_replace on is MoE"),
        ("shared_experts", m.shared_experts == 0, "it always runs n_shared_experts >= 1"),
        ("group_top_k", m.num_groups > 1 and m.top_k // m.group_top_k != 2,
         "a group scores the sum of its best 2 experts (top_k / group_top_k must be 2)"))
        if bad]
    if wrong:
        field, why = wrong[0]
        raise CheckpointError(f"model.moe.{field}: not DeepseekV3ForCausalLM's routing ({why}); Hugging Face "
                              "export of multi-latent attention models covers DeepSeek-V3")


def _rope_parameters(model: ModelConfig) -> dict:
    r = model.rope_scaling
    values = {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
              "original_max_position_embeddings": r.original_max_seq_len, "beta_fast": r.beta_fast,
              "beta_slow": r.beta_slow, "attention_factor": r.attention_factor, "mscale": r.mscale,
              "mscale_all_dim": r.mscale_all_dim, "truncate": r.truncate}
    out = {"rope_type": r.type, "rope_theta": model.rope_theta}
    out.update({k: values[k] for k in ROPE_KEYS[r.type] if values[k] is not None})
    return out


def hf_config(model: ModelConfig, dtype: str, mtp: bool = True) -> dict:
    """config.json that transformers 5 reads as the class model_type_of names. `mtp` False: the
    multi-token prediction modules are left out of the export (num_nextn_predict_layers 0)."""
    kind = model_type_of(model)
    if kind == DEEPSEEK_V3:
        return deepseek_v3_config(model, dtype, mtp)
    if kind == MIXTRAL:
        return mixtral_config(model, dtype, hf_config(dataclasses.replace(model, moe=None), dtype))
    if kind == QWEN3_MOE:
        return qwen3_moe_config(model, dtype, hf_config(dataclasses.replace(model, moe=None), dtype))
    # dynamic NTK takes max_position_embeddings as its pretraining context.
    max_pos = model.rope_scaling.original_max_seq_len if model.rope_scaling.type == "dynamic" else model.max_seq_len
    cfg = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
           "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
           "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
           "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
           "max_position_embeddings": max_pos, "rope_parameters": _rope_parameters(model),
           "rms_norm_eps": model.norm_eps, "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu",
           "attention_dropout": 0.0, "dtype": dtype}
    if kind != "qwen2":
        cfg.update(head_dim=model.head_dim, attention_bias=False)
    if kind == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg["use_sliding_window"] = False
    return cfg


def _refuse(where: str, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={value!r} is not supported: {why}")


def _check_unmodelled(cfg: dict, kind: str, where: str) -> None:
    """Refuse every field value that would make transformers compute something we do not."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", cfg["hidden_act"], "the MLP is SwiGLU (silu)")
    if cfg.get("attention_dropout", 0.0) not in (0, 0.0):
        raise _refuse(where, "attention_dropout", cfg["attention_dropout"], "training runs without dropout")
    if kind != "qwen2" and cfg.get("attention_bias", False) is not False:
        raise _refuse(where, "attention_bias", cfg["attention_bias"],
                      "it biases o_proj too; only q/k/v biases (Qwen2) are modelled")
    if kind == "llama" and cfg.get("mlp_bias", False) is not False:
        raise _refuse(where, "mlp_bias", cfg["mlp_bias"], "the MLP has no biases")
    if kind == MIXTRAL:
        if cfg.get("sliding_window") is not None:
            raise _refuse(where, "sliding_window", cfg["sliding_window"], "attention is full causal")
        if cfg.get("router_jitter_noise", 0.0) not in (0, 0.0):
            raise _refuse(where, "router_jitter_noise", cfg["router_jitter_noise"], "the router adds no noise")
    elif kind != "llama":
        if cfg.get("use_sliding_window", False) is not False:
            raise _refuse(where, "use_sliding_window", cfg["use_sliding_window"], "attention is full causal")
        layer_types = cfg.get("layer_types") or []
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise _refuse(where, "layer_types", layer_types, "every layer has full causal attention")


def rope_from_hf(cfg: dict, where: str, max_pos: Any, default_theta: float = 10000.0) -> tuple[Any, dict]:
    """(rope_theta, our rope_scaling dict) from rope_parameters or rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = cfg.get("rope_scaling") or {}, "rope_scaling"
        params = {**params, "rope_theta": cfg.get("rope_theta", default_theta)} if isinstance(params, dict) else params
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: {key} is {type(params).__name__}; expected a JSON object "
                              "(one set of rope parameters for every layer)")
    theta = params.get("rope_theta", default_theta)
    if key == "rope_parameters" and "rope_theta" in cfg and not cfg["rope_theta"] == theta:
        raise CheckpointError(f"{where}: rope_theta={cfg['rope_theta']!r} disagrees with {key}.rope_theta="
                              f"{theta!r}; keep one")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        raise _refuse(where, f"{key}.rope_type", kind, f"rope types computed exactly: {', '.join(ROPE_KEYS)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, f"{key}.partial_rotary_factor", params["partial_rotary_factor"],
                      "rotary covers the whole head")
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: {key} of rope_type {kind!r} lacks {missing[0]!r}")
    scaling: dict = {"type": kind}
    scaling.update({RENAMES.get(k, k): params[k] for k in ROPE_KEYS[kind] if params.get(k) is not None})
    if kind == "dynamic":
        scaling["original_max_seq_len"] = max_pos
    if kind == "yarn":
        try:
            _yarn_defaults(scaling, params, max_pos)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise CheckpointError(f"{where}: {key}: YaRN values that are not numbers ({exc})") from None
    return theta, scaling


def _yarn_defaults(scaling: dict, params: dict, max_pos: Any) -> None:
    """transformers' derived YaRN values made explicit: factor from the context ratio, the
    attention factor from mscale / mscale_all_dim, falsy betas as 32 / 1."""
    for beta, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        if not params.get(beta):
            scaling[beta] = default
    if params.get("factor") is None:
        scaling["factor"] = max_pos / params["original_max_position_embeddings"]
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if params.get("attention_factor") is None and mscale and mscale_all:
        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        factor = scaling["factor"]
        scaling["attention_factor"] = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)


def model_from_hf_config(cfg: object, where: str, weights_dtype: Optional[str] = None) -> ModelConfig:
    """The ModelConfig of a config.json, through the config schema (types, bounds, finiteness).
    `weights_dtype`: the one dtype the safetensors hold, used when config.json names none."""
    kind = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
    if not isinstance(kind, str) or kind not in IMPORTABLE:
        raise CheckpointError(f"{where}: model_type {kind!r}; importable: {', '.join(map(repr, IMPORTABLE))}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks {missing[0]!r}")
    _check_unmodelled(cfg, kind, where)
    if cfg.get("quantization_config"):
        raise _refuse(where, "quantization_config", cfg["quantization_config"].get("quant_method", "?")
                      if isinstance(cfg["quantization_config"], dict) else cfg["quantization_config"],
                      "quantized weights do not import; dequantize them to bfloat16 first (DeepSeek-V3: its "
                      "inference/fp8_cast_bf16.py)")
    defaults = CLASS_DEFAULTS[kind]
    max_pos = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
    theta, scaling = rope_from_hf(cfg, where, max_pos, defaults.get("rope_theta", 10000.0))
    dtype_key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    dtype = cfg.get(dtype_key) or weights_dtype
    if dtype not in DTYPES:
        raise _refuse(where, dtype_key, dtype, f"parameter dtypes: {', '.join(DTYPES)}")
    fields = {"name": cfg.get("_name_or_path") or f"hf_{kind}", "vocab_size": cfg["vocab_size"],
              "hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
              "num_heads": cfg["num_attention_heads"],
              "num_kv_heads": cfg.get("num_key_value_heads", defaults["num_key_value_heads"]),
              "head_dim": cfg.get("head_dim") or defaults["head_dim"],
              "ffn_hidden_size": cfg["intermediate_size"], "max_seq_len": max_pos,
              "rope_theta": theta, "rope_scaling": scaling, "norm_eps": cfg.get("rms_norm_eps", 1e-6),
              "tie_embeddings": cfg.get("tie_word_embeddings", False), "qkv_bias": kind == "qwen2",
              "qk_norm": kind == "qwen3", "dtype": dtype}
    if kind == "qwen2":
        fields.pop("head_dim")              # Qwen2 has no head_dim field: hidden_size / heads
    if kind == MIXTRAL:
        fields["moe"] = mixtral_moe(cfg)
    if kind == QWEN3_MOE:
        fields.update(qk_norm=True, moe=qwen3_moe(cfg, where))
    if kind == DEEPSEEK_V3:
        _deepseek_v3_fields(cfg, where, fields)
    try:
        return from_dict(ModelConfig, fields, "model")
    except MsLlmError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def is_mixtral(model: ModelConfig) -> bool:
    """A model Mixtral's layout holds: MoE in every layer, no shared experts, normalised top-k."""
    m = model.moe
    return (m is not None and m.shared_experts == 0 and m.layer_freq == 1 and m.first_dense_layers == 0
            and not m.dense_layers and m.normalize_top_k and model.expert_ffn_size == model.ffn_hidden_size)


def mixtral_moe(cfg: dict) -> dict:
    """model.moe of a Mixtral config.json (transformers' MixtralConfig defaults for absent keys)."""
    return {"num_experts": cfg.get("num_local_experts", 8), "top_k": cfg.get("num_experts_per_tok", 2),
            "aux_loss_coeff": cfg.get("router_aux_loss_coef", 0.001)}


def qwen3_moe(cfg: dict, where: str) -> Optional[dict]:
    """model.moe of a Qwen3-MoE config.json: layer i is MoE unless listed in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0 (transformers' Qwen3MoeDecoderLayer); None without experts."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    step, only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise _refuse(where, "decoder_sparse_step", step, "use a positive integer")
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise _refuse(where, "mlp_only_layers", only, "use a list of layer indices")
    if experts == 0:
        return None
    layers = cfg["num_hidden_layers"]
    if step > 1 and (not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS):
        raise _refuse(where, "num_hidden_layers", layers, f"use a layer count from 1 to {MAX_LAYERS}")
    dense = sorted(set(only) | {i for i in range(layers if step > 1 else 0) if (i + 1) % step})
    return {"num_experts": experts, "top_k": cfg.get("num_experts_per_tok", 8),
            "expert_ffn_hidden_size": cfg.get("moe_intermediate_size", 768),
            "normalize_top_k": cfg.get("norm_topk_prob", False),
            "aux_loss_coeff": cfg.get("router_aux_loss_coef", 0.001), "dense_layers": dense}


def qwen3_moe_config(model: ModelConfig, dtype: str, qwen3: dict) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM, from the Qwen3 one: every dense layer
    in mlp_only_layers (whatever rule made it dense), decoder_sparse_step 1."""
    m = model.moe
    dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
    return {**qwen3, "architectures": [ARCHITECTURES[QWEN3_MOE]], "model_type": QWEN3_MOE,
            "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": model.expert_ffn_size, "norm_topk_prob": m.normalize_top_k,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "router_aux_loss_coef": m.aux_loss_coeff}


def _deepseek_v3_fields(cfg: dict, where: str, fields: dict) -> None:
    """ModelConfig fields of a DeepSeek-V3 config.json (transformers' DeepseekV3Config defaults, and
    DeepSeek's own keys scoring_func, topk_method, moe_layer_freq, aux_loss_alpha, seq_aux where set)."""
    heads = cfg["num_attention_heads"]
    if cfg.get("rms_norm_eps", DEEPSEEK_LATENT_EPS) != DEEPSEEK_LATENT_EPS:
        raise _refuse(where, "rms_norm_eps", cfg["rms_norm_eps"], f"DeepseekV3ForCausalLM normalises the q/kv "
                      f"latents with {DEEPSEEK_LATENT_EPS} whatever rms_norm_eps says, ms_llm with rms_norm_eps")
    if cfg.get("num_key_value_heads") not in (None, heads):
        raise _refuse(where, "num_key_value_heads", cfg["num_key_value_heads"],
                      f"multi-latent attention has one key/value head per query head ({heads})")
    for key, value, why in (("scoring_func", "sigmoid", "DeepseekV3ForCausalLM scores experts with a sigmoid"),
                            ("topk_method", "noaux_tc", "DeepseekV3ForCausalLM routes by noaux_tc (score + bias, "
                                                        "group-limited)"),
                            ("moe_layer_freq", 1, "every layer from first_k_dense_replace on is MoE")):
        if cfg.get(key, value) != value:
            raise _refuse(where, key, cfg[key], why)
    groups, group_top_k, top_k = cfg.get("n_group") or 1, cfg.get("topk_group") or 1, cfg.get("num_experts_per_tok", 8)
    if groups > 1 and (not isinstance(top_k, int) or not isinstance(group_top_k, int) or group_top_k < 1
                       or top_k % group_top_k or top_k // group_top_k != 2):
        raise _refuse(where, "topk_group", group_top_k, f"DeepseekV3ForCausalLM scores a group by its best 2 "
                      f"experts, which ms_llm does for num_experts_per_tok / topk_group = 2 (num_experts_per_tok "
                      f"is {top_k})")
    fields.pop("num_kv_heads")
    fields.pop("head_dim")              # transformers writes qk_rope_head_dim there; MLA sets its own
    fields["mla"] = {"q_lora_rank": cfg.get("q_lora_rank", 1536), "kv_lora_rank": cfg.get("kv_lora_rank", 512),
                     "qk_nope_head_dim": cfg.get("qk_nope_head_dim", 128),
                     "qk_rope_head_dim": cfg.get("qk_rope_head_dim", 64), "v_head_dim": cfg.get("v_head_dim", 128),
                     "rope_interleave": cfg.get("rope_interleave", True)}
    layers = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 3)
    fields["mtp_layers"] = cfg.get("num_nextn_predict_layers", 1)
    if isinstance(first_dense, int) and first_dense >= layers:
        return                          # every layer dense: no router to describe
    seq_aux = cfg.get("aux_loss_alpha", 0.0) if cfg.get("seq_aux", False) else 0.0
    fields["moe"] = {"num_experts": cfg.get("n_routed_experts", 256), "top_k": top_k,
                     "expert_ffn_hidden_size": cfg.get("moe_intermediate_size", 2048),
                     "shared_experts": cfg.get("n_shared_experts", 1), "normalize_top_k": cfg.get("norm_topk_prob", True),
                     "first_dense_layers": first_dense, "score_function": "sigmoid",
                     "routed_scaling_factor": cfg.get("routed_scaling_factor", 2.5), "num_groups": groups,
                     "group_top_k": group_top_k, "expert_bias": True, "aux_loss_coeff": 0.0,
                     "seq_aux_loss_coeff": seq_aux}


def deepseek_v3_config(model: ModelConfig, dtype: str, mtp: bool = True) -> dict:
    """config.json for transformers' DeepseekV3ForCausalLM (with DeepSeek's own routing keys, which
    transformers keeps as attributes). A dense model has first_k_dense_replace = num_layers."""
    a, m = model.mla, model.moe
    max_pos = model.rope_scaling.original_max_seq_len if model.rope_scaling.type == "dynamic" else model.max_seq_len
    cfg = {"architectures": [ARCHITECTURES[DEEPSEEK_V3]], "model_type": DEEPSEEK_V3,
           "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
           "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
           "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_heads,
           "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
           "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": a.rope_interleave,
           "max_position_embeddings": max_pos, "rope_parameters": _rope_parameters(model),
           "rms_norm_eps": model.norm_eps, "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu",
           "attention_bias": False, "attention_dropout": 0.0, "dtype": dtype,
           "num_nextn_predict_layers": model.mtp_layers if mtp else 0}
    if m is None:
        return {**cfg, "first_k_dense_replace": model.num_layers}
    return {**cfg, "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": model.expert_ffn_size, "n_shared_experts": m.shared_experts,
            "norm_topk_prob": m.normalize_top_k, "first_k_dense_replace": m.first_dense_layers,
            "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.num_groups, "topk_group": m.group_top_k,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
            "aux_loss_alpha": m.seq_aux_loss_coeff, "seq_aux": m.seq_aux_loss_coeff > 0}


def mixtral_config(model: ModelConfig, dtype: str, llama: dict) -> dict:
    """config.json for transformers' MixtralForCausalLM, from the LLaMA one (`llama`)."""
    m = model.moe
    drop = ("attention_bias", "mlp_bias")
    return {**{k: v for k, v in llama.items() if k not in drop}, "architectures": ["MixtralForCausalLM"],
            "model_type": MIXTRAL, "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coeff, "router_jitter_noise": 0.0, "sliding_window": None,
            "torch_dtype": dtype}
