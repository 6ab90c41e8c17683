"""model.moe <-> MindFormers' MoE keys, in both layouts.

2.x (use_legacy: False) holds MoE as flat keys its config classes map onto one TransformerConfig
field each (MOE_FIELDS lists the spellings: the Hugging Face ones its DeepseekV3 / TeleChat3-MoE /
Qwen3-MoE configs take, and TransformerConfig's own). Its router (training_graph TopKRouter) is
ms_llm's: softmax or sigmoid scores, the expert bias for selection only (moved by the
TopkBiasBalanceCallback), group-limited top-k scoring a group by its best top_k / group_top_k
scores, renormalised weights (norm_topk_prob) times moe_router_topk_scaling_factor. Its balance
loss is one of sub_seq_aux_loss (per micro-batch shard: ms_llm's aux_loss_coeff), seq_aux_loss
(per sequence: seq_aux_loss_coeff) or gbs_aux_loss (over the global batch: not modelled). r1.x
holds a moe_config section (MindSpore's MoEConfig).
"""
from __future__ import annotations

from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import Fields, moe_layers, moe_pattern

# IR field -> the 2.x spellings of one TransformerConfig field (first found wins; the others must agree).
MOE_FIELDS = {"num_experts": ("num_experts", "n_routed_experts", "num_moe_experts"),
              "top_k": ("num_experts_per_tok", "moe_router_topk"),
              "expert_ffn_hidden_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
              "shared_experts": ("n_shared_experts", "shared_expert_num"),
              "normalize_top_k": ("norm_topk_prob",),
              "z_loss_coeff": ("moe_z_loss_coeff", "z_loss_factor"),
              "capacity_factor": ("moe_expert_capacity_factor", "capacity_factor"),
              "first_dense_layers": ("first_k_dense_replace",),
              "routed_scaling_factor": ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
              "num_groups": ("n_group", "moe_router_num_groups"),
              "group_top_k": ("topk_group", "moe_router_group_topk"),
              "expert_bias": ("moe_router_enable_expert_bias", "balance_via_topk_bias"),
              "bias_update_rate": ("moe_router_bias_update_rate", "topk_bias_update_rate")}
AUX_COEFF_KEYS = ("moe_aux_loss_coeff", "router_aux_loss_coef")
# moe_router_load_balancing_type -> the IR coefficient its moe_aux_loss_coeff sets.
BALANCE = {"sub_seq_aux_loss": "aux_loss_coeff", "seq_aux_loss": "seq_aux_loss_coeff",
           "gbs_aux_loss": "aux_loss_coeff"}
SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
# Keys whose usual values say nothing the IR models (dispatch, fusion, dtype of the router).
MOE_NEUTRAL = {"moe_token_dispatcher_type": None, "use_fused_ops_topkrouter": None, "moe_router_dtype": None,
               "moe_router_pre_softmax": (True, False), "moe_token_drop_policy": ("position",),
               "moe_shared_expert_overlap": (True, False), "moe_permute_fusion": (True, False),
               "use_pad_tokens": (True, False), "moe_router_fusion": (True, False), "topk_method": None,
               "moe_router_force_expert_balance": (False,), "npu_nums_per_device": None,
               "moe_grouped_gemm": (True, False), "router_dense_type": ("float32",)}
# r1.x moe_config keys (MindFormers' modules/transformer/moe.py MoEConfig) -> model.moe.
LEGACY_MOE_FIELDS = {"num_experts": "expert_num", "top_k": "num_experts_chosen",
                     "expert_ffn_hidden_size": "moe_intermediate_size", "shared_experts": "shared_expert_num",
                     "normalize_top_k": "norm_topk_prob", "aux_loss_coeff": "aux_loss_factor",
                     "z_loss_coeff": "z_loss_factor", "capacity_factor": "capacity_factor"}
# r1.x MoEConfig defaults that differ from the IR's (its capacity_factor 1.1 drops tokens; 0.05 aux loss).
LEGACY_MOE_DEFAULTS = {"top_k": 1, "capacity_factor": 1.1, "aux_loss_coeff": 0.05}
# Routing fields r1.x's MoE has no key for, at the value it computes.
ROUTING = {"score_function": "softmax", "routed_scaling_factor": 1.0, "num_groups": 1, "group_top_k": 1,
           "expert_bias": False, "bias_update_rate": 1e-3, "seq_aux_loss_coeff": 0.0}
# The 2.x spelling each model class takes for the keys its constructor defaults (a TransformerConfig
# spelling beside a class default would be a conflicting second source for one field).
CLASS_KEYS = {"deepseek_v3": {"num_experts": "n_routed_experts", "num_groups": "n_group", "group_top_k": "topk_group"},
              "qwen3_moe": {"num_experts": "num_experts", "num_groups": "moe_router_num_groups",
                            "group_top_k": "moe_router_group_topk"}}


def _kind(field: str) -> type:
    if field in ("normalize_top_k", "expert_bias"):
        return bool
    return float if any(w in field for w in ("coeff", "factor", "rate")) else int


def read_mcore_moe(f: Fields, mc: str, model: dict, warnings: list[str], arch: str) -> dict | None:
    """model.moe from the flat 2.x keys; `arch` names the model class (for messages)."""
    moe: dict = {}
    for field, keys in MOE_FIELDS.items():
        key = next((f"{mc}.{k}" for k in keys if f.raw(f"{mc}.{k}") is not None), None)
        if key is None:
            continue
        moe[field] = f.get(key, _kind(field), ir=f"model.moe.{field}")
        f.accept_usual({k: (f.peek(key),) for k in keys}, f"{mc}.")     # the same value spelled twice
    if not moe.get("num_experts"):
        return None
    f.accept_usual(MOE_NEUTRAL, f"{mc}.")
    _read_routing(f, mc, moe, warnings, arch)
    _read_balance(f, mc, moe, warnings)
    if "capacity_factor" not in moe:            # dropless: no token is dropped, by any policy
        f.accept_usual({"moe_token_drop_policy": None}, f"{mc}.")
    if f.raw(f"{mc}.moe_shared_expert_intermediate_size") is not None:
        moe["shared_width"] = f.get(f"{mc}.moe_shared_expert_intermediate_size", int, ir="model.moe.shared_experts")
    moe.update(_read_layers(f, mc, model["num_layers"], moe.pop("first_dense_layers", 0)))
    return with_widths(moe, model, f, mc)


def _read_routing(f: Fields, mc: str, moe: dict, warnings: list[str], arch: str) -> None:
    """Score function, group-limited routing and the expert bias, as MindFormers builds them."""
    score = f.get(f"{mc}.moe_router_score_function", SCORES, "softmax", ir="model.moe.score_function")
    for alias in ("scoring_func", "use_gating_sigmoid"):       # dropped by its config classes
        value = f.raw(f"{mc}.{alias}")
        said = {True: "sigmoid", False: "softmax"}.get(value, value) if alias == "use_gating_sigmoid" else value
        if value is not None and said != score:
            warnings.append(f"{mc}.{alias} = {value!r}: MindFormers 2.x's {arch} does not read it; "
                            f"moe_router_score_function = {score} applies")
    if score == "sqrtsoftplus":
        warnings.append(f"{mc}.moe_router_score_function = sqrtsoftplus (DeepSeek-V4's sqrt(softplus) scores): not "
                        "expressible; read as sigmoid")
        score = "sigmoid"
    moe["score_function"] = score
    for field in ("num_groups", "group_top_k"):                 # 0 / null: no group-limited routing
        if not moe.get(field):
            moe[field] = 1
    if moe["num_groups"] == 1:
        moe["group_top_k"] = 1
    if moe.get("routed_scaling_factor") is None:
        moe.pop("routed_scaling_factor", None)
    moe.setdefault("bias_update_rate", 1e-3)                   # TransformerConfig's default
    if moe.get("expert_bias") and score == "softmax":
        raise f.error(f"{mc}.moe_router_enable_expert_bias", "True needs sigmoid scores (MindFormers refuses the "
                                                             "expert bias with moe_router_score_function softmax)")


def _read_balance(f: Fields, mc: str, moe: dict, warnings: list[str]) -> None:
    """moe_router_load_balancing_type picks which loss moe_aux_loss_coeff weights."""
    kind = f.get(f"{mc}.moe_router_load_balancing_type", tuple(BALANCE), "sub_seq_aux_loss",
                 ir="model.moe.aux_loss_coeff")
    key = next((f"{mc}.{k}" for k in AUX_COEFF_KEYS if f.raw(f"{mc}.{k}") is not None), None)
    coeff = f.get(key, float, ir=f"model.moe.{BALANCE[kind]}") if key else 0.0   # TransformerConfig's default
    f.accept_usual({k: (coeff,) for k in AUX_COEFF_KEYS}, f"{mc}.")
    moe.update(aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0)
    moe[BALANCE[kind]] = coeff
    if kind == "gbs_aux_loss":
        warnings.append(f"{mc}.moe_router_load_balancing_type = gbs_aux_loss (the balance loss over the global "
                        "batch): not expressible; read as the micro-batch loss, model.moe.aux_loss_coeff")


def _read_layers(f: Fields, mc: str, layers: int, first: int) -> dict:
    """first_k_dense_replace, else moe_layer_freq (an interval or a 0/1 flag per layer), as
    MindFormers' get_gpt_decoder_block_spec places MoE layers."""
    freq = f.raw(f"{mc}.moe_layer_freq", 1, ir="model.moe.layer_freq")
    first = max(first, 0)                                       # -1: none dense
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise f.error(f"{mc}.moe_layer_freq", f"got {freq!r}; expected an interval or a 0/1 flag per layer")
    if first:
        if isinstance(freq, int) and freq > 1 or isinstance(freq, list) and freq != [0] * first + [1] * (layers - first):
            raise f.error(f"{mc}.moe_layer_freq", f"{freq!r} contradicts first_k_dense_replace: {first} (MindFormers "
                                                  "refuses the pair); keep one")
        return {"first_dense_layers": first}
    if isinstance(freq, int):
        return {"layer_freq": freq}
    if len(freq) != layers or set(freq) - {0, 1} or 1 not in freq:
        raise f.error(f"{mc}.moe_layer_freq", f"{freq!r} is not a 0/1 flag for each of the {layers} layers with "
                                              "at least one MoE layer")
    return moe_layers(freq)


def with_widths(moe: dict, model: dict, f: Fields | None = None, mc: str = "") -> dict:
    """Expert width -1 when it is the dense width; a shared width as a count of experts (MindFormers:
    the width wins over the count); no capacity (None, or MindFormers' negative) as -1, dropless."""
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


def legacy_section(f: Fields, mc: str) -> str:
    """Where r1.x holds its moe_config: in model_config, or at the top."""
    return f"{mc}.moe_config" if f.has(f"{mc}.moe_config") else "moe_config"


def read_legacy_moe(f: Fields, mc: str, model: dict) -> dict | None:
    """r1.x MoE: a moe_config section (in model_config or at the top), MindSpore's MoEConfig keys."""
    section = legacy_section(f, mc)
    if not f.get(f"{section}.expert_num", int, 0, ir="model.moe.num_experts"):
        return None
    moe = {}
    for field, key in LEGACY_MOE_FIELDS.items():
        if f.has(f"{section}.{key}"):
            moe[field] = f.get(f"{section}.{key}", _kind(field), ir=f"model.moe.{field}")
        elif field in LEGACY_MOE_DEFAULTS:
            moe[field] = LEGACY_MOE_DEFAULTS[field]
    return with_widths(moe, model)


def write_mcore_moe(m: ModelConfig, arch: str, warnings: list[str]) -> dict:
    """model.moe as the 2.x keys of model class `arch` (deepseek_v3 or qwen3_moe, CLASS_KEYS)."""
    moe, names = m.moe, CLASS_KEYS[arch]
    out: dict = {names["num_experts"]: moe.num_experts, "num_experts_per_tok": moe.top_k,
                 "moe_intermediate_size": m.expert_ffn_size, "norm_topk_prob": moe.normalize_top_k,
                 "moe_router_score_function": moe.score_function, "routed_scaling_factor": moe.routed_scaling_factor,
                 names["num_groups"]: moe.num_groups, names["group_top_k"]: moe.group_top_k,
                 "moe_router_enable_expert_bias": moe.expert_bias, "moe_router_bias_update_rate": moe.bias_update_rate,
                 "moe_grouped_gemm": True}              # MindFormers 2.1 builds grouped-GEMM experts only
    if moe.expert_bias and moe.score_function == "softmax":
        warnings.append("model.moe.expert_bias = True: MindFormers takes the expert bias with sigmoid scores only "
                        "(it refuses softmax); not written")
        out["moe_router_enable_expert_bias"] = False
    out.update(_write_balance(moe, warnings))
    if arch == "deepseek_v3":                       # its class defaults one shared expert
        out["n_shared_experts"] = moe.shared_experts
    if moe.shared_experts:
        out["moe_shared_expert_intermediate_size"] = moe.shared_experts * m.expert_ffn_size
    if moe.z_loss_coeff:
        out["moe_z_loss_coeff"] = moe.z_loss_coeff
    if moe.capacity_factor > 0:
        out.update(moe_expert_capacity_factor=moe.capacity_factor, moe_token_drop_policy="position")
    out.update(_write_layers(m, arch, warnings))
    return out


def _write_balance(moe, warnings: list[str]) -> dict:
    """One balance loss: the sequence-wise one when set, else the micro-batch one."""
    if moe.seq_aux_loss_coeff and moe.aux_loss_coeff:
        warnings.append(f"model.moe.aux_loss_coeff = {moe.aux_loss_coeff}: MindFormers weighs one balance loss; "
                        f"the sequence-wise one (seq_aux_loss, {moe.seq_aux_loss_coeff}) is written")
    if moe.seq_aux_loss_coeff:
        return {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": moe.seq_aux_loss_coeff}
    return {"moe_router_load_balancing_type": "sub_seq_aux_loss", "moe_aux_loss_coeff": moe.aux_loss_coeff}


def _write_layers(m: ModelConfig, arch: str, warnings: list[str]) -> dict:
    """Dense layers as first_k_dense_replace, an interval, or a flag per layer; Qwen3MoeForCausalLM
    builds every layer from one MoE spec, so it places none."""
    moe = m.moe
    regular = not moe.dense_layers and not (moe.first_dense_layers and moe.layer_freq > 1)
    if arch == "qwen3_moe":
        if m.moe_layers != tuple(range(m.num_layers)):
            warnings.append(f"model.moe.first_dense_layers = {moe.first_dense_layers}, model.moe.layer_freq = "
                            f"{moe.layer_freq}, model.moe.dense_layers = {list(moe.dense_layers)}: MindFormers 2.1's "
                            "Qwen3MoeForCausalLM makes every layer MoE (it drops first_k_dense_replace, "
                            "moe_layer_freq, mlp_only_layers and decoder_sparse_step); not written")
        return {}
    if regular:
        return {"first_k_dense_replace": moe.first_dense_layers, "moe_layer_freq": moe.layer_freq}
    return {"first_k_dense_replace": 0, "moe_layer_freq": moe_pattern(m)}


def write_legacy_moe(m: ModelConfig, warnings: list[str]) -> dict:
    """model.moe as r1.x's moe_config (MindSpore MoEConfig keys, LEGACY_MOE_FIELDS)."""
    moe = m.moe
    out = {"expert_num": moe.num_experts, "num_experts_chosen": moe.top_k, "moe_intermediate_size": m.expert_ffn_size,
           "shared_expert_num": moe.shared_experts, "norm_topk_prob": moe.normalize_top_k,
           "z_loss_factor": moe.z_loss_coeff, "capacity_factor": moe.capacity_factor}
    if 0 < moe.aux_loss_coeff < 1:
        out["aux_loss_factor"] = moe.aux_loss_coeff
    else:
        warnings.append(f"model.moe.aux_loss_coeff = {moe.aux_loss_coeff}: r1.x's MoEConfig takes an "
                        "aux_loss_factor in (0, 1); its default 0.05 applies")
    if m.moe_layers != tuple(range(m.num_layers)):
        warnings.append(f"model.moe.first_dense_layers = {moe.first_dense_layers}, model.moe.layer_freq = "
                        f"{moe.layer_freq}, model.moe.dense_layers = {list(moe.dense_layers)}: r1.x's LLaMA makes "
                        "every layer MoE; use the 2.x layout (--to mindformers2)")
    routing = {k: getattr(moe, k) for k in ROUTING if getattr(moe, k) != ROUTING[k]}
    if routing:
        warnings.append(f"model.moe: {', '.join(f'{k} = {v}' for k, v in routing.items())}: r1.x's router is a "
                        "softmax top-k without groups, bias or scaling; use the 2.x layout (--to mindformers2)")
    return out

