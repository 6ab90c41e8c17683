"""Rotary frequencies shared by both backends, computed as transformers' modeling_rope_utils does.

Every step mirrors transformers 5 in float32 (integer arange cast to float, the same operation
order), so imported Llama-3.1 / YaRN checkpoints give the logits transformers gives. The result
is (inv_freq over head_dim / 2, attention_factor): each backend takes the outer product with the
positions and scales cos / sin by the factor (only YaRN's is not 1).
"""
from __future__ import annotations

import math

import numpy as np

from ms_llm.config.model import ModelConfig

F32 = np.float32


def _plain(theta: float, dim: int) -> np.ndarray:
    return (F32(1.0) / (F32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)))).astype(F32)


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    r = cfg.rope_scaling
    old = r.original_max_seq_len
    low_wavelen, high_wavelen = old / r.low_freq_factor, old / r.high_freq_factor
    wavelen = (F32(2 * math.pi) / inv_freq).astype(F32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / F32(r.factor), inv_freq).astype(F32)
    smooth = ((F32(old) / wavelen - F32(r.low_freq_factor)) / F32(r.high_freq_factor - r.low_freq_factor)).astype(F32)
    smoothed = ((1 - smooth) * scaled / F32(r.factor) + smooth * scaled).astype(F32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature m(factor) = 0.1 x mscale x ln(factor) + 1 (1 when not extending)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, float]:
    r = cfg.rope_scaling
    base, factor = cfg.rope_theta, r.factor
    attention_factor = r.attention_factor
    if attention_factor is None:
        if r.mscale and r.mscale_all_dim:
            attention_factor = yarn_mscale(factor, r.mscale) / yarn_mscale(factor, r.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(r.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                     # transformers' guard against a zero-width ramp
    pos_freqs = (F32(base) ** (np.arange(0, dim, 2).astype(F32) / F32(dim))).astype(F32)
    extrapolation = (F32(1.0) / pos_freqs).astype(F32)
    interpolation = (F32(1.0) / (F32(factor) * pos_freqs)).astype(F32)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    keep = (F32(1) - ramp).astype(F32)
    return (interpolation * (F32(1) - keep) + extrapolation * keep).astype(F32), float(attention_factor)


def inv_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 (rope_dim / 2,), attention_factor) for cfg.rope_scaling."""
    dim, kind = cfg.rope_dim, cfg.rope_scaling.type
    if kind == "yarn":
        return _yarn(cfg, dim)
    inv_freq = _plain(cfg.rope_theta, dim)
    if kind == "linear":
        inv_freq = (inv_freq / F32(cfg.rope_scaling.factor)).astype(F32)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, cfg)
    # "dynamic" (NTK) rescales only past max_position_embeddings = max_seq_len, which no position reaches.
    return inv_freq, 1.0
