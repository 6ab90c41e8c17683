"""`model.model_config` of a MindFormers YAML -> ModelConfig fields, in either of its layouts.

r1.x (and MindFormers 2.x with use_legacy: True) writes LlamaConfig keys (num_layers, num_heads,
n_kv_heads, theta, param_init_type); 2.x with use_legacy: False writes Hugging Face keys
(num_hidden_layers, num_attention_heads, num_key_value_heads, rope_theta, params_dtype) read by
its mcore model configs, with MoE as flat keys (MOE_FIELDS: num_experts or n_routed_experts,
num_experts_per_tok, moe_intermediate_size, n_shared_experts, first_k_dense_replace, ...); r1.x
holds MoE in a moe_config section (LEGACY_MOE_FIELDS). One table per layout names each key; the IR field
is the same. A key whose value changes the math in a way the IR cannot express yet is named in
a warning of its own (the model is still read, as the nearest LLaMA).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ms_llm.config.hf import RENAMES, rope_from_hf
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.convert.common import DTYPES, ConversionError, Fields
from ms_llm.errors import CheckpointError

MC = "model.model_config"


@dataclass(frozen=True)
class Layout:
    """The model_config key MindFormers uses for each IR model field, and its defaults."""
    name: str
    num_layers: str
    num_heads: str
    num_kv_heads: str
    max_seq_len: str
    rope_theta: str
    params_dtype: str
    params_default: str
    compute_default: str
    eps_default: float


LEGACY = Layout("r1.x", "num_layers", "num_heads", "n_kv_heads", "max_position_embedding", "theta",
                "param_init_type", "float16", "float16", 1e-5)
MCORE = Layout("2.x", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
               "rope_theta", "params_dtype", "float32", "bfloat16", 1e-6)

# 2.x keys whose usual value says nothing the IR does not already model (LLaMA math, weight
# layout, the dtype of a norm or softmax).
NEUTRAL = {"hidden_act": ("silu", "swiglu", "fusedswiglu"), "position_embedding_type": ("rope",),
           "add_bias_linear": (False,),
           "attention_dropout": (0.0, 0), "hidden_dropout": (0.0, 0), "gated_linear_unit": (True,),
           "use_cache": (True, False), "input_sliced_sig": (True, False), "qkv_concat": (True, False),
           "use_contiguous_weight_layout_attention": (True, False), "layernorm_compute_dtype": ("float32",),
           "softmax_compute_dtype": ("float32",), "rotary_dtype": ("float32",), "initializer_range": None,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "model_type": None,
           "architectures": None, "moe_grouped_gemm": (True, False), "router_dense_type": ("float32",),
           "fp32_residual_connection": (True, False), "batch_size": None, "type": ("LlamaConfig",),
           "offset": (0,)}
# What MindFormers' config class fills in for a key the YAML leaves out (shipped configs rely on it).
CLASS_DEFAULTS = {"qwen3": {"head_dim": 128}, "deepseek_v3": {"num_attention_heads": 128, "n_routed_experts": 256,
                                  "num_experts_per_tok": 8},
                  "qwen3_moe": {"norm_topk_prob": False}}
# Architectures whose mcore model builds q/k RMSNorm whatever qk_layernorm says.
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# 2.x spellings of Qwen2's q/k/v biases (MindFormers' TransformerConfig maps all three to add_qkv_bias).
QKV_BIAS_KEYS = ("attention_bias", "add_qkv_bias", "qkv_has_bias")
# r1.x FreqsMgr's extend_method -> the keys of its scaling_factor mapping ("None": plain, "PI": a
# number, linear interpolation of positions; "linear" is refused by MindFormers' own check, "NTK"
# scales theta).
EXTEND_METHODS = {"None": (), "PI": (), "LLAMA3": ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings"),
                  "YARN": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                           "mscale_all_dim")}
# model.moe from the 2.x flat keys: IR field -> the spellings MindFormers' transformer_config_utils maps
# to one TransformerConfig field (first found wins). Shared experts are a count or a total width.
MOE_FIELDS = {"num_experts": ("num_experts", "n_routed_experts", "num_moe_experts"),
              "top_k": ("num_experts_per_tok", "moe_router_topk"),
              "expert_ffn_hidden_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
              "shared_experts": ("n_shared_experts", "shared_expert_num"),
              "normalize_top_k": ("norm_topk_prob",),
              "aux_loss_coeff": ("moe_aux_loss_coeff", "router_aux_loss_coef"),
              "z_loss_coeff": ("moe_z_loss_coeff", "z_loss_factor"),
              "capacity_factor": ("moe_expert_capacity_factor", "capacity_factor"),
              "first_dense_layers": ("first_k_dense_replace",),
              "layer_freq": ("moe_layer_freq",)}
# r1.x moe_config keys (MindFormers' modules/transformer/moe.py MoEConfig) -> model.moe.
LEGACY_MOE_FIELDS = {"num_experts": "expert_num", "top_k": "num_experts_chosen",
                     "expert_ffn_hidden_size": "moe_intermediate_size", "shared_experts": "shared_expert_num",
                     "normalize_top_k": "norm_topk_prob", "aux_loss_coeff": "aux_loss_factor",
                     "z_loss_coeff": "z_loss_factor", "capacity_factor": "capacity_factor"}
# r1.x MoEConfig defaults that differ from the IR's (its capacity_factor 1.1 drops tokens; 0.05 aux loss).
LEGACY_MOE_DEFAULTS = {"top_k": 1, "capacity_factor": 1.1, "aux_loss_coeff": 0.05}
# 2.x routing and dispatch keys at values that are ms_llm's router (softmax top-k, no bias, no groups).
MOE_NEUTRAL = {"moe_router_score_function": ("softmax",), "scoring_func": ("softmax",),
               "moe_router_enable_expert_bias": (False,), "routed_scaling_factor": (1.0, 1),
               "moe_router_topk_scaling_factor": (None, 1.0, 1), "moe_router_load_balancing_type": ("aux_loss",),
               "moe_token_dispatcher_type": None, "use_fused_ops_topkrouter": None, "moe_router_dtype": None,
               "moe_router_pre_softmax": (True, False), "moe_token_drop_policy": ("position",),
               "moe_shared_expert_overlap": (True, False), "moe_permute_fusion": (True, False),
               "use_pad_tokens": (True, False), "moe_router_fusion": (True, False)}

def layout_of(f: Fields) -> Layout:
    """2.x when the YAML says use_legacy: False (or writes the mcore key names), r1.x otherwise."""
    legacy = f.get("use_legacy", bool, True)
    if not legacy or f.has(f"{MC}.num_hidden_layers"):
        return MCORE
    return LEGACY


def read_model(f: Fields, layout: Layout, warnings: list[str], mc: str = MC, given: ModelConfig | None = None) -> dict:
    """ModelConfig fields (as a dict) from the model section `mc`; `given` (--model) supplies the
    shape when the YAML leaves it to a Hugging Face folder (pretrained_model_dir)."""
    f.accept_usual(NEUTRAL, f"{mc}.")
    if given is not None:
        return {k: v for k, v in to_dict(given, full=True).items() if k not in ("name", "dtype")}
    if not f.has(f"{mc}.hidden_size") and f.has("pretrained_model_dir"):
        raise f.error(f"{mc}.hidden_size", f"missing: the shape is in {f.raw('pretrained_model_dir')}/config.json "
                                           "(pretrained_model_dir); pass --model NAME or --model path/to/model.yaml")
    section = _section(f, mc)
    for key, value in CLASS_DEFAULTS.get(section.get("model_type"), {}).items():
        section.setdefault(key, value)
    hidden = f.get(f"{mc}.hidden_size", int, ir="model.hidden_size")
    heads = f.get(f"{mc}.{layout.num_heads}", int, ir="model.num_heads")
    kv_key = f"{mc}.{layout.num_kv_heads}"
    kv = f.get(kv_key, int, ir="model.num_kv_heads") if f.raw(kv_key) is not None else heads
    seq = f.get(f"{mc}.seq_length", int, 4096 if layout is MCORE else None, ir="train.seq_len")
    model = {"vocab_size": f.get(f"{mc}.vocab_size", int, ir="model.vocab_size"), "hidden_size": hidden,
             "num_layers": f.get(f"{mc}.{layout.num_layers}", int, ir="model.num_layers"), "num_heads": heads,
             "num_kv_heads": kv, "ffn_hidden_size": _ffn(f, mc, hidden),
             "max_seq_len": f.get(f"{mc}.{layout.max_seq_len}", int, seq, ir="model.max_seq_len"),
             "rope_theta": f.get(f"{mc}.{layout.rope_theta}", float, 10000.0, ir="model.rope_theta"),
             "norm_eps": f.get(f"{mc}.rms_norm_eps", float, layout.eps_default, ir="model.norm_eps"),
             "tie_embeddings": f.get(f"{mc}.tie_word_embeddings", bool, False, ir="model.tie_embeddings"),
             "flash_attention": f.get(f"{mc}.use_flash_attention", bool, False, ir="model.flash_attention")}
    untie = f.peek(f"{mc}.untie_embeddings_and_output_weights")
    if untie is not None:
        tie = f.get(f"{mc}.untie_embeddings_and_output_weights", bool, ir="model.tie_embeddings") is False
        if f.has(f"{mc}.tie_word_embeddings") and tie != model["tie_embeddings"]:
            raise f.error(f"{mc}.untie_embeddings_and_output_weights", f"{untie} contradicts tie_word_embeddings: "
                                                                      f"{model['tie_embeddings']}; keep one of them")
        model["tie_embeddings"] = tie
    if layout is MCORE:
        _mcore_math(f, mc, model, warnings)
    else:
        _legacy_math(f, mc, model, warnings)
        _legacy_moe(f, mc, model)
    return model


def _section(f: Fields, mc: str) -> dict:
    """The model mapping itself, without marking it read (its keys are checked one by one)."""
    section = f.peek(mc)
    if not isinstance(section, dict):
        raise f.error(mc, "missing; expected the model's settings (hidden_size, vocab_size, ...)")
    return section


def _ffn(f: Fields, mc: str, hidden: int) -> int:
    if f.raw(f"{mc}.intermediate_size") is not None:
        return f.get(f"{mc}.intermediate_size", int, ir="model.ffn_hidden_size")
    multiplier = f.raw(f"{mc}.ffn_dim_multiplier", ir="model.ffn_hidden_size")
    multiple_of = f.get(f"{mc}.multiple_of", int, 256, ir="model.ffn_hidden_size")
    if multiplier is not None:
        multiplier = f.get(f"{mc}.ffn_dim_multiplier", float)
    return mindformers_ffn(hidden, multiple_of, multiplier)


def mindformers_ffn(hidden: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU width MindFormers' LlamaFeedForward derives when intermediate_size is unset. It
    differs from Meta's rule: the multiplier (plus 0.01) scales 4h before the 2/3."""
    f = 4 * hidden
    if ffn_dim_multiplier is not None:
        f = int((ffn_dim_multiplier + 0.01) * f)
    f = int(2 * f / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


def _legacy_math(f: Fields, mc: str, model: dict, warnings: list[str]) -> None:
    """r1.x LlamaConfig: qkv_has_bias, and FreqsMgr's extend_method with its scaling_factor."""
    model["qkv_bias"] = f.get(f"{mc}.qkv_has_bias", bool, False, ir="model.qkv_bias")
    method = f.get(f"{mc}.extend_method", tuple(EXTEND_METHODS) + ("NTK",), "None", ir="model.rope_scaling")
    if method == "NTK":
        factor = f.get(f"{mc}.scaling_factor", float, 1.0)
        warnings.append(f"{mc}.extend_method = NTK: static NTK (theta x scaling_factor {factor}) read as rope_theta "
                        f"{model['rope_theta'] * factor}")
        model["rope_theta"] *= factor
    elif method == "PI":
        model["rope_scaling"] = {"type": "linear", "factor": f.get(f"{mc}.scaling_factor", float, 1.0,
                                                                   ir="model.rope_scaling")}
    elif method != "None":
        sf = f"{mc}.scaling_factor"
        values = {key: f.get(f"{sf}.{key}", float if key != "original_max_position_embeddings" else int,
                             ir="model.rope_scaling") for key in EXTEND_METHODS[method]}
        scaling = {"type": method.lower(), **{RENAMES.get(k, k): v for k, v in values.items()
                                              if k not in ("mscale", "mscale_all_dim")}}
        if method == "YARN":
            attention = yarn_mscale(values["factor"], values["mscale"]) / \
                yarn_mscale(values["factor"], values["mscale_all_dim"])
            if not math.isclose(attention, yarn_mscale(values["factor"], 1.0)):     # else transformers' default
                scaling["attention_factor"] = attention
        model["rope_scaling"] = scaling


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention scale, as MindFormers and transformers compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _legacy_moe(f: Fields, mc: str, model: dict) -> None:
    """r1.x MoE: a moe_config section (in model_config or at the top), MindSpore's MoEConfig keys."""
    section = f"{mc}.moe_config" if f.has(f"{mc}.moe_config") else "moe_config"
    if not f.get(f"{section}.expert_num", int, 0, ir="model.moe.num_experts"):
        model["moe"] = None
        return
    moe = {}
    for field, key in LEGACY_MOE_FIELDS.items():
        kind = bool if field == "normalize_top_k" else float if "coeff" in field or "factor" in field else int
        if f.has(f"{section}.{key}"):
            moe[field] = f.get(f"{section}.{key}", kind, ir=f"model.moe.{field}")
        elif field in LEGACY_MOE_DEFAULTS:
            moe[field] = LEGACY_MOE_DEFAULTS[field]
    model["moe"] = _moe_with_widths(moe, model)

def _mcore_math(f: Fields, mc: str, model: dict, warnings: list[str]) -> None:
    """2.x keys that change the math: read what the IR models, name the rest one by one."""
    mla = f.raw(f"{mc}.multi_latent_attention") is True
    if f.raw(f"{mc}.head_dim") is not None and not mla:
        model["head_dim"] = f.get(f"{mc}.head_dim", int, ir="model.head_dim")
    arch = f.raw(f"{mc}.architectures", "")
    arch = arch[0] if isinstance(arch, list) and arch else arch
    qk_norm = f.get(f"{mc}.qk_layernorm", bool, False, ir="model.qk_norm")
    if mla and qk_norm:       # MLA's qk_layernorm normalizes the latent q / kv, which GQA has not
        warnings.append(f"{mc}.qk_layernorm: {arch or 'this model'} normalizes the latent q and kv of multi-latent "
                        "attention; not expressible, read without it")
    elif qk_norm or arch in QK_NORM_ARCHS:
        model["qk_norm"] = True
    bias = [k for k in QKV_BIAS_KEYS if f.get(f"{mc}.{k}", bool, False, ir="model.qkv_bias")]
    model["qkv_bias"] = bool(bias)
    if f.raw(f"{mc}.add_bias_linear") is True:
        warnings.append(f"{mc}.add_bias_linear = True: biases on o_proj and the MLP are not expressible (only q/k/v "
                        "biases are: add_qkv_bias); read without them")
    if f.raw(f"{mc}.rope_scaling") is not None:
        model["rope_scaling"] = _rope_scaling(f, mc, model)
    if mla:
        mla_keys = sorted(k for k in _section(f, mc)
                          if "lora_rank" in k or k.startswith(("qk_", "v_head", "mla_", "o_")))
        f.used.update(f"{mc}.{k}" for k in mla_keys + ["multi_latent_attention"])
        warnings.append(f"{mc}.multi_latent_attention = True ({', '.join(mla_keys)}): latent attention is not "
                        "expressible; read as grouped-query attention with num_attention_heads heads")
    model["moe"] = _mcore_moe(f, mc, model)


def _mcore_moe(f: Fields, mc: str, model: dict) -> dict | None:
    """model.moe from the flat 2.x keys (MOE_FIELDS); routing keys at other values than ms_llm's
    router stay unread, so the unused-key warnings name them."""
    moe = {}
    for field, keys in MOE_FIELDS.items():
        key = next((f"{mc}.{k}" for k in keys if f.raw(f"{mc}.{k}") is not None), None)
        if key is None:
            continue
        kind = bool if field == "normalize_top_k" else float if "coeff" in field or "factor" in field else int
        moe[field] = f.get(key, kind, ir=f"model.moe.{field}")
        f.accept_usual({k: (f.peek(key),) for k in keys}, f"{mc}.")     # the same value spelled twice
    if not moe.get("num_experts"):
        return None
    moe.setdefault("aux_loss_coeff", 0.0)          # TransformerConfig.moe_aux_loss_coeff's default
    f.accept_usual(MOE_NEUTRAL, f"{mc}.")
    if "capacity_factor" not in moe:            # dropless: no token is dropped, by any policy
        f.accept_usual({"moe_token_drop_policy": None}, f"{mc}.")
    if f.raw(f"{mc}.moe_shared_expert_intermediate_size") is not None and "shared_experts" not in moe:
        moe["shared_width"] = f.get(f"{mc}.moe_shared_expert_intermediate_size", int, ir="model.moe.shared_experts")
    return _moe_with_widths(moe, model, f, mc)


def _moe_with_widths(moe: dict, model: dict, f: Fields | None = None, mc: str = "") -> dict:
    """Expert width -1 when it is the dense width; a shared width as a count of experts; no
    capacity (None, or MindFormers' negative) as -1, dropless."""
    width = moe.get("expert_ffn_hidden_size", -1)
    if width == model["ffn_hidden_size"]:
        moe["expert_ffn_hidden_size"] = width = -1
    shared = moe.pop("shared_width", 0)
    if shared:
        each = model["ffn_hidden_size"] if width == -1 else width
        if shared % each:
            raise f.error(f"{mc}.moe_shared_expert_intermediate_size", f"{shared} is not a multiple of the expert "
                                                                       f"width {each}; ms_llm's shared experts are "
                                                                       "expert-wide")
        moe["shared_experts"] = shared // each
    if moe.get("capacity_factor") is not None and moe["capacity_factor"] <= 0:
        moe["capacity_factor"] = -1.0
    return moe

def _rope_scaling(f: Fields, mc: str, model: dict) -> dict:
    """rope_scaling in Hugging Face's spelling (MindFormers' configs copy config.json), read as
    transformers reads it."""
    cfg = {"rope_scaling": f.get(f"{mc}.rope_scaling", dict, ir="model.rope_scaling"),
           "rope_theta": model["rope_theta"]}
    try:
        return rope_from_hf(cfg, f"{f.source}: {mc}", model["max_seq_len"])[1]
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None


def read_dtypes(f: Fields, layout: Layout, mc: str = MC) -> tuple[str, str]:
    """(compute dtype, stored parameter dtype)."""
    compute = f.get(f"{mc}.compute_dtype", DTYPES, layout.compute_default, ir="strategy.precision.compute_dtype")
    stored = f.get(f"{mc}.{layout.params_dtype}", DTYPES, layout.params_default, ir="strategy.precision.master_dtype")
    return compute, stored
