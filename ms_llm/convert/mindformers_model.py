"""`model.model_config` of a MindFormers YAML -> ModelConfig fields, in either of its layouts.

r1.x (and MindFormers 2.x with use_legacy: True) writes LlamaConfig keys (num_layers, num_heads,
n_kv_heads, theta, param_init_type); 2.x with use_legacy: False writes Hugging Face keys
(num_hidden_layers, num_attention_heads, num_key_value_heads, rope_theta, params_dtype) read by
its mcore model configs, with MoE as flat keys (num_experts or n_routed_experts,
num_experts_per_tok, moe_intermediate_size). One table per layout names each key; the IR field
is the same. A key whose value changes the math in a way the IR cannot express yet is named in
a warning of its own (the model is still read, as the nearest LLaMA).
"""
from __future__ import annotations

from dataclasses import dataclass

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.convert.common import DTYPES, Fields

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
           "add_bias_linear": (False,), "attention_bias": (False,), "qk_layernorm": (False,),
           "attention_dropout": (0.0, 0), "hidden_dropout": (0.0, 0), "gated_linear_unit": (True,),
           "use_cache": (True, False), "input_sliced_sig": (True, False), "qkv_concat": (True, False),
           "use_contiguous_weight_layout_attention": (True, False), "layernorm_compute_dtype": ("float32",),
           "softmax_compute_dtype": ("float32",), "rotary_dtype": ("float32",), "initializer_range": None,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "model_type": None,
           "architectures": None, "moe_grouped_gemm": (True, False), "router_dense_type": ("float32",),
           "fp32_residual_connection": (True, False), "batch_size": None, "type": ("LlamaConfig",),
           "offset": (0,)}
# What MindFormers' config class fills in for a key the YAML leaves out (shipped configs rely on it).
CLASS_DEFAULTS = {"deepseek_v3": {"num_attention_heads": 128, "n_routed_experts": 256,
                                  "num_experts_per_tok": 8}}
# Architectures whose mcore model builds q/k RMSNorm whatever qk_layernorm says.
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Not yet in the IR: a later round adds model.moe (routing, shared experts, dense first layers).
MOE_KEYS = ("first_k_dense_replace", "n_shared_experts", "moe_shared_expert_intermediate_size", "routed_scaling_factor",
            "norm_topk_prob", "scoring_func", "moe_router_pre_softmax", "moe_token_drop_policy",
            "moe_router_load_balancing_type", "moe_aux_loss_coeff", "router_aux_loss_coef",
            "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "n_group", "topk_group",
            "moe_token_dispatcher_type", "use_fused_ops_topkrouter", "moe_router_score_function",
            "moe_router_group_topk", "moe_router_force_expert_balance", "moe_router_dtype", "use_pad_tokens")


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


def _legacy_moe(f: Fields, mc: str, model: dict) -> None:
    """r1.x MoE: a moe_config section (in model_config or at the top); its other keys (routing,
    capacity, aux loss) are named by the unused-key warnings until the IR's model.moe lands."""
    section = f"{mc}.moe_config" if f.has(f"{mc}.moe_config") else "moe_config"
    experts = f.get(f"{section}.expert_num", int, 0, ir="model.num_experts")
    model["num_experts"] = experts
    if experts:
        model["moe_top_k"] = f.get(f"{section}.num_experts_chosen", int, 1, ir="model.moe_top_k")


def _mcore_math(f: Fields, mc: str, model: dict, warnings: list[str]) -> None:
    """2.x keys that change the math: read what the IR models, name the rest one by one."""
    heads, hidden = model["num_heads"], model["hidden_size"]
    head_dim = f.get(f"{mc}.head_dim", int, hidden // heads)
    if head_dim != hidden // heads:
        warnings.append(f"{mc}.head_dim = {head_dim}: not yet expressible (the IR derives head_dim = hidden_size / "
                        f"num_attention_heads = {hidden // heads}); read with {hidden // heads}")
    arch = f.raw(f"{mc}.architectures", "")
    arch = arch[0] if isinstance(arch, list) and arch else arch
    if f.raw(f"{mc}.qk_layernorm") is True or arch in QK_NORM_ARCHS:
        warnings.append(f"{mc}.qk_layernorm: {arch or 'this model'} normalizes q and k per head (RMSNorm); not yet "
                        "expressible, read without it")
    for key in ("attention_bias", "add_bias_linear"):
        if f.raw(f"{mc}.{key}") is True:
            warnings.append(f"{mc}.{key} = True: biased projections are not yet expressible; read without bias")
    if f.raw(f"{mc}.multi_latent_attention") is True:
        mla = sorted(k for k in _section(f, mc) if "lora_rank" in k or k.startswith(("qk_", "v_head", "mla_", "o_")))
        f.used.update(f"{mc}.{k}" for k in mla + ["multi_latent_attention"])
        warnings.append(f"{mc}.multi_latent_attention = True ({', '.join(mla)}): latent attention is not "
                        "expressible; read as grouped-query attention with num_attention_heads heads")
    experts_key = f"{mc}.num_experts" if f.has(f"{mc}.num_experts") else f"{mc}.n_routed_experts"
    experts = f.get(experts_key, int, 0, ir="model.num_experts") if f.raw(experts_key) is not None else 0
    model["num_experts"] = experts
    if experts:
        model["moe_top_k"] = f.get(f"{mc}.num_experts_per_tok", int, 2, ir="model.moe_top_k")
        if f.has(f"{mc}.moe_intermediate_size"):
            dense = model["ffn_hidden_size"]
            model["ffn_hidden_size"] = f.get(f"{mc}.moe_intermediate_size", int, ir="model.ffn_hidden_size")
            if dense != model["ffn_hidden_size"] and f.has(f"{mc}.intermediate_size"):
                warnings.append(f"{mc}.intermediate_size = {dense}: the width of dense MLP layers, which the IR "
                                "does not hold beside experts; every layer read as MoE with moe_intermediate_size")
        for key in MOE_KEYS:
            if f.has(f"{mc}.{key}"):
                f.used.add(f"{mc}.{key}")
                warnings.append(f"{mc}.{key} = {f.raw(mc + '.' + key)!r}: not yet expressible (model.moe); dropped")


def read_dtypes(f: Fields, layout: Layout, mc: str = MC) -> tuple[str, str]:
    """(compute dtype, stored parameter dtype)."""
    compute = f.get(f"{mc}.compute_dtype", DTYPES, layout.compute_default, ir="strategy.precision.compute_dtype")
    stored = f.get(f"{mc}.{layout.params_dtype}", DTYPES, layout.params_default, ir="strategy.precision.master_dtype")
    return compute, stored
