"""`model.model_config` of a MindFormers YAML -> ModelConfig fields, in either of its layouts.

r1.x (and MindFormers 2.x with use_legacy: True) writes LlamaConfig keys (num_layers, num_heads,
n_kv_heads, theta, param_init_type); 2.x with use_legacy: False writes Hugging Face keys
(num_hidden_layers, num_attention_heads, num_key_value_heads, rope_theta, params_dtype) read by
its mcore model configs, whose classes fill in what a YAML leaves out (CLASS_DEFAULTS: DeepSeek-V3's
shape for deepseek_v3). MoE keys are read by mindformers/moe.py, multi-latent attention and MTP by
mindformers/mla.py. A key whose value changes the math in a way the IR cannot express is named
in a warning of its own; an attention the IR has no form for at all is refused by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ms_llm.config.hf import RENAMES, rope_from_hf
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.convert.common import DTYPES, ConversionError, Fields
from ms_llm.convert.mindformers.mla import read_mla
from ms_llm.convert.mindformers.moe import read_legacy_moe, read_mcore_moe
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
# What MindFormers' config classes fill in for a key the YAML leaves out (their constructor
# defaults and register_mf_model_parameter values; shipped configs rely on them).
DEEPSEEK_V3 = {"num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "moe_intermediate_size": 2048,
               "num_nextn_predict_layers": 1, "max_position_embeddings": 4096, "moe_router_score_function": "sigmoid",
               "moe_router_enable_expert_bias": True, "multi_latent_attention": True}
CLASS_DEFAULTS = {"qwen3": {"head_dim": 128},
                  "qwen3_moe": {"norm_topk_prob": False, "num_experts": 128, "num_experts_per_tok": 8,
                                "moe_intermediate_size": 768, "max_position_embeddings": 32768},
                  "deepseek_v3": DEEPSEEK_V3,
                  "telechat3_moe": {**DEEPSEEK_V3, "num_attention_heads": 32, "n_routed_experts": 192,
                                    "routed_scaling_factor": 2.8, "moe_intermediate_size": 1536,
                                    "multi_latent_attention": False},
                  "deepseek_v4": {"experimental_attention_variant": "dsv4_hybrid"}}
# Attention variants with no ms_llm form: what each is.
ATTENTION_VARIANTS = {"dsv4_hybrid": "DeepSeek-V4's compressed sparse attention with a grouped low-rank output "
                                     "projection and hyper-connections",
                      "dsa": "DeepSeek-V3.2's sparse attention with a lightning indexer"}
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
        model["moe"] = read_legacy_moe(f, mc, model)
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


def _mcore_math(f: Fields, mc: str, model: dict, warnings: list[str]) -> None:
    """2.x keys that change the math: read what the IR models, name the rest one by one."""
    section = _section(f, mc)
    variant = section.get("experimental_attention_variant")
    if variant is not None:
        what = ATTENTION_VARIANTS.get(variant, "an attention variant")
        raise f.error(f"{mc}.experimental_attention_variant", f"{variant!r} ({what}) has no ms_llm form; convert "
                                                              "the parallel layout alone with --model NAME")
    arch = f.raw(f"{mc}.architectures", "")
    arch = (arch[0] if isinstance(arch, list) and arch else arch) or "this model"
    mla = section.get("multi_latent_attention") is True
    if f.raw(f"{mc}.head_dim") is not None and not mla:
        model["head_dim"] = f.get(f"{mc}.head_dim", int, ir="model.head_dim")
    if not mla and (f.get(f"{mc}.qk_layernorm", bool, False, ir="model.qk_norm") or arch in QK_NORM_ARCHS):
        model["qk_norm"] = True
    bias = [k for k in QKV_BIAS_KEYS if f.get(f"{mc}.{k}", bool, False, ir="model.qkv_bias")]
    model["qkv_bias"] = bool(bias)
    if f.raw(f"{mc}.add_bias_linear") is True:
        warnings.append(f"{mc}.add_bias_linear = True: biases on o_proj and the MLP are not expressible (only q/k/v "
                        "biases are: add_qkv_bias); read without them")
    if f.raw(f"{mc}.rope_scaling") is not None and not mla:
        model["rope_scaling"] = _rope_scaling(f, mc, model)
    read_mla(f, mc, model, warnings, arch)
    model["moe"] = read_mcore_moe(f, mc, model, warnings, arch)
    _dense_layers(f, mc, model, warnings, arch)


def _dense_layers(f: Fields, mc: str, model: dict, warnings: list[str], arch: str) -> None:
    """Qwen3-MoE's mlp_only_layers and decoder_sparse_step: MindFormers' Qwen3MoeConfig drops them
    (its model makes every layer MoE), so they are read as it builds the model, and named."""
    for key, usual in (("mlp_only_layers", ([], None)), ("decoder_sparse_step", (1, None))):
        value = f.raw(f"{mc}.{key}")
        if value not in usual:
            warnings.append(f"{mc}.{key} = {value!r}: MindFormers 2.x's {arch} drops it and makes every layer MoE; "
                            "read as it builds the model")


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
