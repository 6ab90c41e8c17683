"""Tiny models of each family the HF import covers, shared by the parity tests of both backends."""
from __future__ import annotations

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict

# A tiny GQA model in each family, with rope scaling set apart from the default (Llama-3.1's
# "llama3" with an original context that puts frequencies in each of its three bands) and Qwen3's
# head_dim set apart from hidden / heads.
LLAMA31 = dict(rope_theta=10000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_seq_len": 64})
FAMILIES = {
    "llama3.1": LLAMA31,
    "llama-yarn": dict(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 8,
                                                         "beta_fast": 8.0}),
    "llama-linear": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "llama-dynamic": dict(rope_scaling={"type": "dynamic", "factor": 4.0, "original_max_seq_len": 32}),
    "qwen2": dict(rope_theta=1e6, qkv_bias=True),
    "qwen3": dict(rope_theta=1e6, qk_norm=True, head_dim=24),
}


def family_config(family: str, **over) -> ModelConfig:
    return from_dict(ModelConfig, {"vocab_size": 96, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                   "num_kv_heads": 2, "ffn_hidden_size": 160, "max_seq_len": 32,
                                   "norm_eps": 1e-6, "dtype": "float32", **FAMILIES[family], **over}, "model")
