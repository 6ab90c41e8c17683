"""model.mla, its rotary embedding and multi-token prediction <-> MindFormers 2.x's keys.

MindFormers' MLA (training_graph MLASelfAttention, DeepseekV3ForCausalLM and TeleChat3-MoE) is
transformers' DeepseekV3Attention: q through q_lora_rank (q_lora_rank null: q_proj), keys and
values from kv_lora_rank plus a qk_rope_head_dim rotary key, pairs de-interleaved before rotary
(rope_interleave), and, with qk_layernorm, RMSNorms over the q and kv latents (ms_llm's MLA
always has them). Two of its rules differ from transformers': it multiplies the softmax scale by
m(rotary_scaling_factor, mscale)^2, m(f, x) = 0.1 x ln(f) + 1, whatever position_embedding_type
says (its MLATransformerConfig defaults 40 and 0.707, so a YAML that leaves them out trains a
sharper softmax), and its YaRN scales the rotary angle, not cos/sin, by
m(f, mscale) / m(f, mscale_all_dim). YaRN's pretraining context is max_position_embeddings.
MTP: num_nextn_predict_layers (one depth: MindFormers builds no more) and mtp_loss_factor.
"""
from __future__ import annotations

import math

from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import Fields

# IR field -> the 2.x spellings (first found wins).
MLA_FIELDS = {"q_lora_rank": ("q_lora_rank",), "kv_lora_rank": ("kv_lora_rank",),
              "qk_nope_head_dim": ("qk_nope_head_dim", "qk_head_dim"),
              "qk_rope_head_dim": ("qk_rope_head_dim", "qk_pos_emb_head_dim"), "v_head_dim": ("v_head_dim",)}
MTP_FIELDS = {"mtp_layers": ("num_nextn_predict_layers", "mtp_depth", "mtp_num_layers"),
              "mtp_loss_factor": ("mtp_loss_factor", "mtp_loss_scaling_factor")}
# MLATransformerConfig's YaRN defaults, and the spellings of its scaling factor.
YARN_DEFAULTS = {"rotary_scaling_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                 "mscale_all_dim": 0.707}
FACTOR_KEYS = ("rotary_scaling_factor", "scaling_factor", "factor")
MLA_NEUTRAL = {"mla_qkv_concat": (True, False), "use_attn_mask_compression": (True, False),
               "apply_rope_fusion": (True, False), "bias_swiglu_fusion": (True, False),
               "rotary_interleaved": (False,), "rotary_percent": (1.0, 1)}


def m_scale(factor: float, mscale: float) -> float:
    """YaRN's m(f, x) as MindFormers' _yarn_get_mscale computes it (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_mla(f: Fields, mc: str, model: dict, warnings: list[str], arch: str) -> None:
    """model.mla (and the rotary it reads) when multi_latent_attention is on; MTP either way."""
    for field, keys in MTP_FIELDS.items():
        key = next((f"{mc}.{k}" for k in keys if f.raw(f"{mc}.{k}") is not None), None)
        if key is not None:
            model[field] = f.get(key, int if field == "mtp_layers" else float, ir=f"model.{field}")
            f.accept_usual({k: (f.peek(key),) for k in keys}, f"{mc}.")
    if f.raw(f"{mc}.multi_latent_attention") is not True:
        return
    f.get(f"{mc}.multi_latent_attention", bool, ir="model.mla")
    f.accept_usual(MLA_NEUTRAL, f"{mc}.")
    mla = {}
    for field, keys in MLA_FIELDS.items():
        key = next((f"{mc}.{k}" for k in keys if f.raw(f"{mc}.{k}") is not None), None)
        if key is not None:
            mla[field] = f.get(key, int, ir=f"model.mla.{field}")
        elif field == "q_lora_rank":
            f.used.add(f"{mc}.q_lora_rank")               # null: q_proj straight from the hidden state
    if not mla.get("q_lora_rank"):
        mla["q_lora_rank"] = None
    mla["rope_interleave"] = True                         # MindFormers de-interleaves the rotary pairs of MLA
    model["mla"] = mla
    if not f.get(f"{mc}.qk_layernorm", bool, False, ir="model.mla"):
        warnings.append(f"{mc}.qk_layernorm = False: {arch} then builds its multi-latent attention without the q and "
                        "kv latent RMSNorms, which ms_llm's always has; read with them")
    # MLA has one key/value head per query head and its own head widths: these keys say nothing.
    f.used.update(f"{mc}.{k}" for k in ("num_key_value_heads", "n_kv_heads", "head_dim", "kv_channels"))
    model["num_kv_heads"] = model["num_heads"]
    model.pop("head_dim", None)
    model["rope_scaling"] = _read_rope(f, mc, model, warnings, arch)


def _read_rope(f: Fields, mc: str, model: dict, warnings: list[str], arch: str) -> dict:
    """position_embedding_type rope or yarn (or a Hugging Face rope_scaling, which MindFormers
    unpacks into the same keys) with MLATransformerConfig's YaRN keys."""
    hf = f.get(f"{mc}.rope_scaling", dict, ir="model.rope_scaling") if f.raw(f"{mc}.rope_scaling") else {}
    kind = hf.get("rope_type", hf.get("type")) or f.get(f"{mc}.position_embedding_type", ("rope", "yarn"), "rope",
                                                        ir="model.rope_scaling")
    values = dict(YARN_DEFAULTS)
    key = next((f"{mc}.{k}" for k in FACTOR_KEYS if f.raw(f"{mc}.{k}") is not None), None)
    if key is not None:
        values["rotary_scaling_factor"] = f.get(key, float, ir="model.rope_scaling.factor")
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        values[name] = f.get(f"{mc}.{name}", float, values[name], ir=f"model.rope_scaling.{name}")
    values.update({("rotary_scaling_factor" if k == "factor" else k): float(v) for k, v in hf.items()
                   if k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")})
    if "original_max_position_embeddings" in hf:
        model["max_seq_len"] = int(hf["original_max_position_embeddings"])
    factor, mscale, mscale_all = values["rotary_scaling_factor"], values["mscale"], values["mscale_all_dim"]
    softmax = m_scale(factor, mscale) ** 2
    if kind == "rope" or factor <= 1:
        if not math.isclose(softmax, 1.0):
            warnings.append(f"{mc}: {arch} multiplies the softmax scale of its multi-latent attention by "
                            f"(0.1 x mscale {mscale:g} x ln(rotary_scaling_factor {factor:g}) + 1)^2 = {softmax:.4g} "
                            "even with plain rotary (MLATransformerConfig's defaults are 40 and 0.707); ms_llm scales it "
                            "only under YaRN; read without it (set rotary_scaling_factor: 1 to train what ms_llm does)")
        return {}
    if not math.isclose(mscale, mscale_all):
        warnings.append(f"{mc}.mscale = {mscale:g}, mscale_all_dim = {mscale_all:g}: MindFormers scales YaRN's rotary "
                        f"angle by their ratio {m_scale(factor, mscale) / m_scale(factor, mscale_all):.4g}, which ms_llm "
                        "cannot; read with the softmax scale it takes from mscale and an unscaled rotary")
    scaling = {"type": "yarn", "factor": factor, "original_max_seq_len": model["max_seq_len"],
               "beta_fast": values["beta_fast"], "beta_slow": values["beta_slow"]}
    if mscale:       # the softmax takes m(f, mscale)^2 and the rotary is unscaled: ms_llm's mscale_all_dim
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    else:
        scaling["attention_factor"] = 1.0
    return scaling


def write_mla(m: ModelConfig, warnings: list[str]) -> dict:
    """DeepseekV3ForCausalLM's attention, rotary and MTP keys for model.mla (its class defaults are
    DeepSeek-V3's, so every key is written)."""
    a = m.mla
    out: dict = {"multi_latent_attention": True, "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
                 "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
                 "v_head_dim": a.v_head_dim, "qk_layernorm": True, "num_key_value_heads": m.num_heads}
    if not a.rope_interleave:
        warnings.append("model.mla.rope_interleave = False: MindFormers de-interleaves the rotary pairs of "
                        "multi-latent attention (DeepSeek's checkpoint layout); written as it does")
    out.update(_write_rope(m, warnings))
    return out


def _write_rope(m: ModelConfig, warnings: list[str]) -> dict:
    r = m.rope_scaling
    if r.type != "yarn":
        if r.type != "default":
            warnings.append(f"model.rope_scaling.type = {r.type}: MindFormers' multi-latent attention takes plain "
                            "rotary or YaRN; plain written")
        # rotary_scaling_factor 1 keeps MindFormers' softmax scale at 1 / sqrt(qk_head_dim), as ms_llm's
        return {"position_embedding_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "max_position_embeddings": m.max_seq_len}
    scale = r.mscale_all_dim or 0.0
    rotary = r.attention_factor if r.attention_factor is not None else \
        m_scale(r.factor, r.mscale) / m_scale(r.factor, r.mscale_all_dim) if r.mscale and r.mscale_all_dim else \
        m_scale(r.factor, 1.0)
    if not math.isclose(rotary, 1.0):
        warnings.append(f"model.rope_scaling: YaRN's cos/sin scale {rotary:.4g}: MindFormers scales the rotary angle "
                        "instead; written unscaled (mscale = mscale_all_dim)")
    if m.max_seq_len != r.original_max_seq_len:
        warnings.append(f"model.max_seq_len = {m.max_seq_len}: MindFormers' YaRN takes max_position_embeddings as the "
                        f"pretraining context; rope_scaling.original_max_seq_len = {r.original_max_seq_len} written there")
    if not r.truncate:
        warnings.append("model.rope_scaling.truncate = False: MindFormers rounds YaRN's ramp bounds; written as True")
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": r.factor, "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow, "mscale": scale, "mscale_all_dim": scale,
            "max_position_embeddings": r.original_max_seq_len}


def write_mtp(m: ModelConfig, warnings: list[str]) -> dict:
    if m.mtp_layers > 1:
        warnings.append(f"model.mtp_layers = {m.mtp_layers}: MindFormers 2.1 builds one MTP depth; 1 written")
    return {"num_nextn_predict_layers": min(m.mtp_layers, 1), "mtp_loss_factor": m.mtp_loss_factor}
