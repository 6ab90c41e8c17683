"""The model flags of Megatron-LM's arguments <-> ModelConfig, both ways (megatron-core 0.16's
TransformerConfig / MLATransformerConfig, as Megatron-LM's arguments.py names and defaults them).

- GPT/LLaMA: --num-layers ... --swiglu, --group-query-attention, --kv-channels, --qk-layernorm,
  --add-qkv-bias, rotary scaling (--use-rope-scaling: Llama-3.1 with fixed bands; linear
  interpolation by a whole factor).
- Multi-latent attention (--multi-latent-attention): --q-lora-rank (unset: q_proj), --kv-lora-rank,
  --qk-head-dim (the no-rotary part), --qk-pos-emb-head-dim, --v-head-dim; --qk-layernorm gives
  the latent norms (without it Megatron's MLA has none); rotary pairs de-interleaved
  (rope_interleave); --rope-type yarn (MLA's default) with --rotary-scaling-factor, --mscale,
  --mscale-all-dim over a 4096-token pretraining context with betas 32 / 1 (MLATransformerConfig's,
  no flags), --rope-type rope for plain rotary.
- MoE: --num-experts and the --moe-* flags (megatron/moe.py).
- Multi-token prediction: --mtp-num-layers, --mtp-loss-scaling-factor (default 0.1).
"""
from __future__ import annotations

import math
from pathlib import Path

from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import Fields, num
from ms_llm.convert.megatron.moe import read_moe, write_moe

GPT2_BPE_VOCAB = 50257          # Megatron's GPT2BPETokenizer (the GPT-3 examples' --vocab-file/--merge-file)
# megatron-core's RotaryEmbedding._apply_scaling: Llama-3.1's bands fixed, only the factor is an argument.
MEGATRON_LLAMA3 = {"type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
# MLATransformerConfig's YaRN values that have no flag.
MLA_YARN = {"original_max_seq_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def m_scale(factor: float, mscale: float) -> float:
    """YaRN's m(f, x) = 0.1 x ln(f) + 1 (megatron-core's _yarn_get_mscale; 1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_model(f: Fields, tp: int, pp: int, warnings: list[str]) -> tuple[dict, str]:
    """ModelConfig fields from the flags, and a note on tied embeddings under pipeline parallel."""
    layers = f.get("--num-layers", int, ir="model.num_layers")
    hidden = f.get("--hidden-size", int, ir="model.hidden_size")
    heads = f.get("--num-attention-heads", int, ir="model.num_heads")
    kv = heads
    if f.get("--group-query-attention", bool, False):
        kv = f.get("--num-query-groups", int, 1, ir="model.num_kv_heads")
    swiglu = f.get("--swiglu", bool, False)
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
    ffn = f.get("--ffn-hidden-size", int, default_ffn, ir="model.ffn_hidden_size")
    if not swiglu:
        if (2 * ffn) % 3:
            raise f.error("--ffn-hidden-size", f"a {ffn}-wide GELU MLP has no SwiGLU equivalent of equal size "
                                               "(2*ffn/3 is not an integer); ms_llm models are SwiGLU")
        warnings.append(f"no --swiglu: the {ffn}-wide GELU MLP is read as a SwiGLU MLP of width {2 * ffn // 3} "
                        "(same parameter count)")
        ffn = 2 * ffn // 3
    vocab = _vocab(f, tp, warnings)
    position = f.get("--position-embedding-type", str, "learned_absolute")
    if position != "rope":
        warnings.append(f"--position-embedding-type {position}: read as rotary embeddings (ms_llm models use RoPE)")
    if f.get("--rotary-percent", float, 1.0) != 1.0:
        warnings.append("--rotary-percent < 1 is not modelled; full rotary embeddings are used")
    norm = f.get("--normalization", str, "LayerNorm")
    if norm != "RMSNorm":
        warnings.append(f"--normalization {norm}: read as RMSNorm")
    if not f.get("--disable-bias-linear", bool, False):
        warnings.append("linear-layer biases (Megatron's default without --disable-bias-linear) are not modelled; "
                        "only q/k/v biases are (--disable-bias-linear --add-qkv-bias)")
    dropout = (f.get("--attention-dropout", float, 0.1), f.get("--hidden-dropout", float, 0.1))
    if any(dropout):
        warnings.append(f"dropout (attention {dropout[0]}, hidden {dropout[1]}; Megatron's default is 0.1) "
                        "is not modelled")
    tie = not f.get("--untie-embeddings-and-output-weights", bool, False, ir="model.tie_embeddings")
    note = ""
    if tie and pp > 1:
        tie = False
        note = ("embeddings are tied (no --untie-embeddings-and-output-weights) across pipeline stages; "
                "ms_llm has no embedding group, so they are untied")
    seq = f.get("--seq-length", int, ir="train.seq_len")
    model = {"name": Path(f.source).stem, "vocab_size": vocab, "hidden_size": hidden, "num_layers": layers,
             "num_heads": heads, "num_kv_heads": kv, "ffn_hidden_size": ffn,
             "max_seq_len": f.get("--max-position-embeddings", int, seq, ir="model.max_seq_len"),
             "rope_theta": f.get("--rotary-base", float, 10000.0, ir="model.rope_theta"),
             "norm_eps": f.get("--norm-epsilon", float, 1e-5, ir="model.norm_eps"), "tie_embeddings": tie,
             "flash_attention": _flash_attention(f, warnings), "moe": read_moe(f, layers, ffn, warnings),
             "qkv_bias": f.get("--add-qkv-bias", bool, False, ir="model.qkv_bias")}
    model.update(_mtp(f))
    if f.get("--multi-latent-attention", bool, False, ir="model.mla"):
        model.update(_mla(f, warnings))
        return model, note
    model["qk_norm"] = f.get("--qk-layernorm", bool, False, ir="model.qk_norm")
    model["rope_scaling"] = _rope_scaling(f)
    if f.has("--kv-channels"):
        model["head_dim"] = f.get("--kv-channels", int, ir="model.head_dim")
    return model, note


def _mla(f: Fields, warnings: list[str]) -> dict:
    """model.mla and its rotary (Megatron-LM's MLA argument defaults where a flag is absent)."""
    q_lora = f.get("--q-lora-rank", int, None, ir="model.mla.q_lora_rank")
    mla = {"q_lora_rank": q_lora or None, "kv_lora_rank": f.get("--kv-lora-rank", int, 32, ir="model.mla.kv_lora_rank"),
           "qk_nope_head_dim": f.get("--qk-head-dim", int, 128, ir="model.mla.qk_nope_head_dim"),
           "qk_rope_head_dim": f.get("--qk-pos-emb-head-dim", int, 64, ir="model.mla.qk_rope_head_dim"),
           "v_head_dim": f.get("--v-head-dim", int, 128, ir="model.mla.v_head_dim"), "rope_interleave": True}
    if not f.get("--qk-layernorm", bool, False, ir="model.mla"):
        warnings.append("--multi-latent-attention without --qk-layernorm: Megatron's MLA then has no q and kv latent "
                        "RMSNorms, which ms_llm's (and DeepSeek's) always has; read with them")
    f.used.update(("--kv-channels", "--group-query-attention", "--num-query-groups"))    # MLA sets its own
    kind = f.get("--rope-type", ("rope", "yarn"), "yarn", ir="model.rope_scaling")
    factor = f.get("--rotary-scaling-factor", float, 1.0, ir="model.rope_scaling.factor")
    mscale = f.get("--mscale", float, 1.0, ir="model.rope_scaling")
    mscale_all = f.get("--mscale-all-dim", float, 0.0, ir="model.rope_scaling")
    out: dict = {"mla": mla, "num_kv_heads": None, "rope_scaling": {}}
    if kind == "rope" or factor <= 1:
        if kind == "rope" and m_scale(factor, mscale_all) != 1.0:
            warnings.append(f"--rope-type rope with --rotary-scaling-factor {num(factor)} --mscale-all-dim "
                            f"{num(mscale_all)}: Megatron's MLA still scales the softmax by m^2 = "
                            f"{m_scale(factor, mscale_all) ** 2:.4g}; ms_llm does only under YaRN; read without it")
        return out
    scaling = {"type": "yarn", "factor": factor, **MLA_YARN}
    if mscale_all:            # softmax x m(f, mscale_all_dim)^2, cos/sin x m(f, mscale) / m(f, mscale_all_dim)
        scaling.update(mscale=mscale, mscale_all_dim=mscale_all)
    elif mscale != 1.0:       # cos/sin x m(f, mscale); ms_llm's default is m(f, 1)
        scaling["attention_factor"] = m_scale(factor, mscale)
    out["rope_scaling"] = scaling
    return out


def _mtp(f: Fields) -> dict:
    depth = f.get("--mtp-num-layers", int, 0, ir="model.mtp_layers")
    out = {"mtp_layers": depth}
    if depth or f.has("--mtp-loss-scaling-factor"):
        out["mtp_loss_factor"] = f.get("--mtp-loss-scaling-factor", float, 0.1, ir="model.mtp_loss_factor")
    return out


def _rope_scaling(f: Fields) -> dict:
    """--use-rope-scaling is Llama-3.1's scaling with Megatron's fixed bands (MEGATRON_LLAMA3) and
    --rope-scaling-factor; --rotary-seq-len-interpolation-factor divides positions (linear)."""
    if f.get("--use-rope-scaling", bool, False, ir="model.rope_scaling"):
        return {**MEGATRON_LLAMA3, "factor": f.get("--rope-scaling-factor", float, 8.0, ir="model.rope_scaling")}
    linear = f.get("--rotary-seq-len-interpolation-factor", int, 0, ir="model.rope_scaling")
    return {"type": "linear", "factor": linear} if linear else {}


def _flash_attention(f: Fields, warnings: list[str]) -> bool:
    """--attention-backend flash (or the legacy --use-flash-attn) is model.flash_attention."""
    backend = f.get("--attention-backend", ("flash", "fused", "unfused", "local", "auto"), "auto",
                    ir="model.flash_attention")
    if backend in ("fused", "auto") and f.has("--attention-backend"):
        what = "Megatron's pick among Transformer Engine's kernels" if backend == "auto" else "cuDNN fused attention"
        warnings.append(f"--attention-backend {backend} ({what}): read as plain attention "
                        "(model.flash_attention false)")
    legacy = f.get("--use-flash-attn", bool, False, ir="model.flash_attention")
    return backend == "flash" or legacy


def _vocab(f: Fields, tp: int, warnings: list[str]) -> int:
    if f.has("--vocab-size"):
        vocab = f.get("--vocab-size", int, ir="model.vocab_size")
    elif f.has("--merge-file") or f.get("--tokenizer-type", str, "") == "GPT2BPETokenizer":
        vocab = GPT2_BPE_VOCAB
        warnings.append(f"vocabulary: the GPT-2 BPE tokenizer's {GPT2_BPE_VOCAB} tokens")
    else:
        raise f.error("--vocab-size", "missing, and the tokenizer cannot be read offline; add --vocab-size N "
                                      "(the tokenizer's vocabulary size)")
    multiple = f.get("--make-vocab-size-divisible-by", int, 128) * tp
    padded = math.ceil(vocab / multiple) * multiple
    if padded != vocab:
        warnings.append(f"vocabulary padded from {vocab} to {padded} (a multiple of "
                        f"make-vocab-size-divisible-by * tp = {multiple}), as Megatron does")
    return padded


def write_model(m: ModelConfig, seq_len: int, divisible_by: int, warnings: list[str]) -> list[str]:
    """The MODEL_ARGS of a launch script, which read_model reads back to `m`."""
    out = [f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}",
           f"--ffn-hidden-size {m.ffn_hidden_size}", f"--num-attention-heads {m.num_heads}"]
    if m.num_kv_heads != m.num_heads:
        out += ["--group-query-attention", f"--num-query-groups {m.num_kv_heads}"]
    out += [f"--seq-length {seq_len}", f"--max-position-embeddings {m.max_seq_len}",
            "--position-embedding-type rope", f"--rotary-base {num(m.rope_theta)}",
            "--normalization RMSNorm", f"--norm-epsilon {num(m.norm_eps)}", "--swiglu", "--disable-bias-linear",
            "--attention-dropout 0.0", "--hidden-dropout 0.0",
            f"--vocab-size {m.vocab_size}", f"--make-vocab-size-divisible-by {divisible_by}"]
    if not m.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if m.qkv_bias:
        out.append("--add-qkv-bias")
    if m.mla is not None:
        out += _write_mla(m, warnings)
    else:
        if m.head_dim * m.num_heads != m.hidden_size:
            out.append(f"--kv-channels {m.head_dim}")
        if m.qk_norm:
            out.append("--qk-layernorm")
        out += _write_rope_scaling(m.rope_scaling, warnings)
    out += write_moe(m, warnings)
    if m.mtp_layers:
        out += [f"--mtp-num-layers {m.mtp_layers}", f"--mtp-loss-scaling-factor {num(m.mtp_loss_factor)}"]
    elif m.mtp_loss_factor != ModelConfig.__dataclass_fields__["mtp_loss_factor"].default:
        out.append(f"--mtp-loss-scaling-factor {num(m.mtp_loss_factor)}")
    if m.flash_attention:
        out.append("--attention-backend flash")
    return out


def _write_mla(m: ModelConfig, warnings: list[str]) -> list[str]:
    a, r = m.mla, m.rope_scaling
    out = ["--multi-latent-attention", f"--kv-lora-rank {a.kv_lora_rank}", f"--qk-head-dim {a.qk_nope_head_dim}",
           f"--qk-pos-emb-head-dim {a.qk_rope_head_dim}", f"--v-head-dim {a.v_head_dim}", "--qk-layernorm"]
    if a.q_lora_rank is not None:
        out.insert(1, f"--q-lora-rank {a.q_lora_rank}")
    if not a.rope_interleave:
        warnings.append("model.mla.rope_interleave = False: Megatron's MLA de-interleaves the rotary pairs "
                        "(DeepSeek's layout; --rotary-interleaved is refused with MLA); written as it does")
    if r.type != "yarn":
        if r.type != "default":
            warnings.append(f"model.rope_scaling.type = {r.type}: Megatron's MLA takes plain rotary or YaRN; plain "
                            "written")
        return out + ["--rope-type rope"]
    off = {k: getattr(r, k) for k, v in MLA_YARN.items() if getattr(r, k) != v}
    if off:
        warnings.append(f"model.rope_scaling: {', '.join(f'{k} = {v}' for k, v in off.items())}: Megatron's MLA YaRN "
                        f"fixes {', '.join(f'{k} {v}' for k, v in MLA_YARN.items())} (no flags); written with them")
    if r.mscale_all_dim:
        mscale, mscale_all = (r.mscale or 1.0), r.mscale_all_dim
        if r.attention_factor is not None or not r.mscale:
            warnings.append("model.rope_scaling.attention_factor: with mscale_all_dim, Megatron's cos/sin scale is "
                            "m(mscale) / m(mscale_all_dim); written with mscale")
    else:             # cos/sin x m(f, mscale): ms_llm's default m(f, 1), or the attention factor given
        mscale_all = 0.0
        mscale = 1.0 if r.attention_factor is None else (r.attention_factor - 1.0) / (0.1 * math.log(r.factor))
    return out + ["--rope-type yarn", f"--rotary-scaling-factor {num(r.factor)}", f"--mscale {num(mscale)}",
                  f"--mscale-all-dim {num(mscale_all)}"]


def _write_rope_scaling(r, warnings: list[str]) -> list[str]:
    """Llama-3.1 scaling with Megatron's fixed bands, or linear interpolation by a whole factor."""
    if r.type == "default":
        return []
    if r.type == "llama3" and all(getattr(r, k) == v for k, v in MEGATRON_LLAMA3.items()):
        return ["--use-rope-scaling", f"--rope-scaling-factor {num(r.factor)}"]
    if r.type == "linear" and float(r.factor).is_integer():
        return [f"--rotary-seq-len-interpolation-factor {int(r.factor)}"]
    warnings.append(f"model.rope_scaling.type = {r.type}: Megatron-LM's GPT model scales rotary only as Llama-3.1 "
                    "(low_freq_factor 1, high_freq_factor 4, original_max_seq_len 8192) or by a whole linear "
                    "factor; plain rotary written")
    return []
