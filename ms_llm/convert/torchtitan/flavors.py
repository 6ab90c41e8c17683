"""torchtitan's MoE model flavors as their model args, and those args <-> ModelConfig.

torchtitan 0.3 builds DeepSeek-V3 and Qwen3-MoE from flavor functions (models/deepseek_v3 and
models/qwen3 __init__.py) that registered configs name (config_registry.py); v0.2.x TOML names the
flavor itself. The args below are the ones those functions pass (tests/helpers/torchtitan_config_probe.py
reads them back from torchtitan's own configs). What every flavor shares: RMSNorm eps 1e-5
(DeepSeek-V3's, torchtitan's default) or 1e-6 (Qwen3's), untied embeddings, the aux-loss-free
expert bias moved by load_balance_coeff 1e-3 after each step (torchtitan centres the update, which
selects the same experts) and no balance loss, group scores from the best 2 experts of a group (top_k /
group_top_k in every flavor), DeepSeek's complex (interleaved) rotary with YaRN folded into the softmax scale (mscale), Qwen3's
cos/sin (half-split) rotary; MTP modules copy the last layer and MTPLoss weighs them 0.3.
"""
from __future__ import annotations

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict

LOAD_BALANCE_COEFF = 1e-3            # make_moe_config's default: every torchtitan MoE has the expert bias
MTP_SCALE = 0.3                      # MTPLoss.Config.mtp_scale
_YARN = {"max_seq_len": 16384, "theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "original_seq_len": 4096}
_ROUTER = {"router_num_expert_groups": None, "router_num_limited_groups": None, "router_route_scale": 1.0,
           "router_route_norm": False}
DEEPSEEK_V3 = {
    "debugmodel": {"dim": 256, "n_layers": 6, "vocab_size": 2048, "n_heads": 16, "q_lora_rank": 0,
                   "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                   "mscale": 0.70, "dense_hidden_dim": 1024, "moe_hidden_dim": 256, "num_experts": 8,
                   "num_shared_experts": 2, "n_dense_layers": 1, "router_top_k": 3, "router_score_func": "softmax",
                   **_ROUTER, "rope": _YARN},
    "16B": {"dim": 2048, "n_layers": 27, "vocab_size": 102400, "n_heads": 16, "q_lora_rank": 0, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mscale": 0.70,
            "dense_hidden_dim": 10944, "moe_hidden_dim": 1408, "num_experts": 64, "num_shared_experts": 2,
            "n_dense_layers": 1, "router_top_k": 6, "router_score_func": "softmax", **_ROUTER, "rope": _YARN},
    "236B": {"dim": 5120, "n_layers": 60, "vocab_size": 102400, "n_heads": 128, "q_lora_rank": 1536,
             "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mscale": 1.0,
             "dense_hidden_dim": 12288, "moe_hidden_dim": 1536, "num_experts": 160, "num_shared_experts": 2,
             "n_dense_layers": 1, "router_top_k": 6, "router_score_func": "softmax",
             **_ROUTER, "router_num_expert_groups": 8, "router_num_limited_groups": 3, "router_route_scale": 16.0,
             "rope": _YARN},
    "671B": {"dim": 7168, "n_layers": 61, "vocab_size": 129280, "n_heads": 128, "q_lora_rank": 1536,
             "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mscale": 1.0,
             "dense_hidden_dim": 18432, "moe_hidden_dim": 2048, "num_experts": 256, "num_shared_experts": 1,
             "n_dense_layers": 3, "router_top_k": 8, "router_score_func": "sigmoid",
             "router_num_expert_groups": 8, "router_num_limited_groups": 4, "router_route_scale": 2.5,
             "router_route_norm": True, "rope": _YARN},
}
# Qwen3-MoE: every layer MoE with softmax top-k renormalised. `intermediate_size` is the Hugging Face
# config's dense width, which no layer uses; ms_llm's ModelConfig holds it.
QWEN3_MOE = {
    "debugmodel_moe": {"dim": 256, "n_layers": 8, "vocab_size": 2048, "n_heads": 16, "n_kv_heads": 8,
                       "head_dim": 128, "moe_hidden_dim": 768, "num_experts": 64, "top_k": 8,
                       "rope": {"max_seq_len": 4096, "theta": 1000000.0}, "intermediate_size": 3072},
    "30B-A3B": {"dim": 2048, "n_layers": 48, "vocab_size": 151936, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
                "moe_hidden_dim": 768, "num_experts": 128, "top_k": 8,
                "rope": {"max_seq_len": 40960, "theta": 1000000.0}, "intermediate_size": 6144},
    "235B-A22B": {"dim": 4096, "n_layers": 94, "vocab_size": 151936, "n_heads": 64, "n_kv_heads": 4, "head_dim": 128,
                  "moe_hidden_dim": 1536, "num_experts": 128, "top_k": 8,
                  "rope": {"max_seq_len": 40960, "theta": 5000000.0}, "intermediate_size": 12288},
}
FLAVORS = {"deepseek_v3": DEEPSEEK_V3, "qwen3": QWEN3_MOE}
# torchtitan 0.3's registered configs of these flavors: config -> (module, flavor, MTP depth).
REGISTERED = {"deepseek_v3_debugmodel": ("deepseek_v3", "debugmodel", 0),
              "deepseek_v3_debugmodel_mtp": ("deepseek_v3", "debugmodel", 1),
              "deepseek_v3_16b": ("deepseek_v3", "16B", 0), "deepseek_v3_671b": ("deepseek_v3", "671B", 0),
              "qwen3_moe_debug": ("qwen3", "debugmodel_moe", 0), "qwen3_30b_a3b": ("qwen3", "30B-A3B", 0)}


def model_of(name: str, flavor: str) -> dict | None:
    """ModelConfig fields of a registered config (0.3: name is the module) or a flavor (v0.2.x);
    None when neither is one of these MoE flavors."""
    module, flavor, mtp = REGISTERED.get(flavor, (name, flavor, 0))
    args = FLAVORS.get(module, {}).get(flavor)
    if args is None:
        return None
    return _deepseek(args, mtp) if module == "deepseek_v3" else _qwen3_moe(args)


def _moe(experts: int, top_k: int, width: int, dense_width: int, **routing) -> dict:
    return {"num_experts": experts, "top_k": top_k, "expert_ffn_hidden_size": -1 if width == dense_width else width,
            "expert_bias": True, "bias_update_rate": LOAD_BALANCE_COEFF, "aux_loss_coeff": 0.0, **routing}


def _deepseek(a: dict, mtp: int) -> dict:
    rope = a["rope"]
    moe = _moe(a["num_experts"], a["router_top_k"], a["moe_hidden_dim"], a["dense_hidden_dim"],
               shared_experts=a["num_shared_experts"], first_dense_layers=a["n_dense_layers"],
               score_function=a["router_score_func"], normalize_top_k=a["router_route_norm"],
               routed_scaling_factor=a["router_route_scale"], num_groups=a["router_num_expert_groups"] or 1,
               group_top_k=a["router_num_limited_groups"] or 1)
    scaling = {"type": "yarn", "factor": rope["rope_factor"], "original_max_seq_len": rope["original_seq_len"],
               "beta_fast": rope["beta_fast"], "beta_slow": rope["beta_slow"], "mscale": a["mscale"],
               "mscale_all_dim": a["mscale"]} if rope["rope_factor"] > 1 else {}
    return {"vocab_size": a["vocab_size"], "hidden_size": a["dim"], "num_layers": a["n_layers"],
            "num_heads": a["n_heads"], "ffn_hidden_size": a["dense_hidden_dim"], "max_seq_len": rope["max_seq_len"],
            "rope_theta": rope["theta"], "rope_scaling": scaling, "norm_eps": 1e-5,
            "mla": {"q_lora_rank": a["q_lora_rank"] or None, "kv_lora_rank": a["kv_lora_rank"],
                    "qk_nope_head_dim": a["qk_nope_head_dim"], "qk_rope_head_dim": a["qk_rope_head_dim"],
                    "v_head_dim": a["v_head_dim"], "rope_interleave": True},
            "moe": moe, "mtp_layers": mtp, "mtp_loss_factor": MTP_SCALE}


def _qwen3_moe(a: dict) -> dict:
    rope = a["rope"]
    return {"vocab_size": a["vocab_size"], "hidden_size": a["dim"], "num_layers": a["n_layers"],
            "num_heads": a["n_heads"], "num_kv_heads": a["n_kv_heads"], "head_dim": a["head_dim"],
            "ffn_hidden_size": a["intermediate_size"], "max_seq_len": rope["max_seq_len"],
            "rope_theta": rope["theta"], "norm_eps": 1e-6, "qk_norm": True,
            "moe": _moe(a["num_experts"], a["top_k"], a["moe_hidden_dim"], a["intermediate_size"],
                        normalize_top_k=True)}


def match(m: ModelConfig, warnings: list[str]) -> tuple[str, str] | None:
    """(module, registered config) whose model has the shape of `m` (the same MTP depth first), with a
    warning for each field it holds otherwise (routing, balance, MTP, context, norm eps); None when no
    flavor has the shape."""
    found = []
    for config, (module, _, depth) in REGISTERED.items():
        theirs = from_dict(ModelConfig, {**model_of(module, config), "name": m.name, "dtype": m.dtype,
                                         "flash_attention": m.flash_attention}, "model")
        if _shape(theirs) == _shape(m):
            found.append((depth != m.mtp_layers, module, config, theirs))
    if not found:
        return None
    _, module, config, theirs = min(found, key=lambda x: x[0])
    _name_differences(m, theirs, config, warnings)
    return module, config


def _shape(m: ModelConfig) -> tuple:
    moe = m.moe
    return (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.qk_norm,
            m.qkv_bias, m.tie_embeddings, m.mla, m.moe_layers,
            moe and (moe.num_experts, moe.top_k, m.expert_ffn_size, moe.shared_experts),
            m.ffn_hidden_size if moe is None or len(m.moe_layers) < m.num_layers else None)


def _name_differences(m: ModelConfig, theirs: ModelConfig, config: str, warnings: list[str]) -> None:
    ours_moe, their_moe = m.moe.__dict__, theirs.moe.__dict__
    for key in sorted(k for k in ours_moe if ours_moe[k] != their_moe[k]):
        warnings.append(f"model.moe.{key} = {ours_moe[key]}: torchtitan's {config} has {their_moe[key]} (its MoE "
                        "balances with the expert bias alone); written as it has it")
    for key in ("rope_theta", "rope_scaling", "norm_eps", "max_seq_len", "mtp_layers", "mtp_loss_factor"):
        if getattr(m, key) != getattr(theirs, key):
            warnings.append(f"model.{key} = {getattr(m, key)}: torchtitan's {config} has {getattr(theirs, key)}; "
                            "written as it has it")
