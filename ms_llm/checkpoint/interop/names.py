"""Tensor-name tables between ms_llm (Hugging Face LLaMA names) and other stacks.

torchtitan's LLaMA keeps Meta's rotary layout (interleaved pairs of each head's q/k rows)
while Hugging Face uses rotate_half (first half / second half), so wq and wk rows are
permuted on the way (torchtitan's own Llama3StateDictAdapter does the same). Names are written
as torchtitan 0.3 has them (q/k/v under attention.qkv_linear, the head as lm_head) and read in
0.3's or v0.2.x's spelling (attention.wq, output).
"""
from __future__ import annotations

import re

import numpy as np

from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError

_TO_TORCHTITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_V02 = {"layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
        "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
        "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
        "output.weight": "lm_head.weight"}
_FROM_TORCHTITAN = {v: k for k, v in _TO_TORCHTITAN.items()} | _V02


def _lookup(table: dict[str, str], name: str, what: str) -> tuple[str, str]:
    """(abstract source key, concrete target name) for `name`."""
    m = re.search(r"\.(\d+)\.", name)
    abstract = name.replace(f".{m.group(1)}.", ".{}.", 1) if m else name
    if abstract not in table:
        raise CheckpointError(f"tensor {name!r} has no {what} name (dense LLaMA weights only)")
    target = table[abstract]
    return abstract, target.format(m.group(1)) if m else target


def _rows(model: ModelConfig, hf_abstract: str) -> int:
    """Heads whose rotary rows a permutation reorders (0 for tensors without rotary)."""
    if hf_abstract.endswith("q_proj.weight"):
        return model.num_heads
    if hf_abstract.endswith("k_proj.weight"):
        return model.num_kv_heads
    return 0


def hf_to_meta_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """rotate_half row order -> interleaved pairs (torchtitan's _reverse_permute)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def meta_to_hf_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Interleaved pairs -> rotate_half row order (torchtitan's _permute)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def torchtitan_name(name: str) -> str:
    """torchtitan's state-dict name of ms_llm tensor `name`."""
    return _lookup(_TO_TORCHTITAN, name, "torchtitan")[1]


def hf_name_of_torchtitan(name: str) -> str:
    """ms_llm's name of torchtitan state-dict entry `name`."""
    return _lookup(_FROM_TORCHTITAN, name, "Hugging Face")[1]


def to_torchtitan(name: str, w: np.ndarray, model: ModelConfig) -> tuple[str, np.ndarray]:
    abstract, target = _lookup(_TO_TORCHTITAN, name, "torchtitan")
    heads = _rows(model, abstract)
    return target, hf_to_meta_rotary(w, heads) if heads else w


def from_torchtitan(name: str, w: np.ndarray, model: ModelConfig) -> tuple[str, np.ndarray]:
    _, target = _lookup(_FROM_TORCHTITAN, name, "Hugging Face")
    heads = _rows(model, _lookup(_TO_TORCHTITAN, target, "torchtitan")[0])
    return target, meta_to_hf_rotary(w, heads) if heads else w

