"""Tensor-name tables between ms_llm (Hugging Face LLaMA names) and other stacks (torchtitan, Megatron-LM).

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


# Megatron-core's GPTModel under its distributed-checkpoint keys: every layer's tensor stacked on a leading
# layer axis under one key, the norms under the fused linears' layer_norm_weight (Transformer Engine's names,
# which the local layer spec's checkpoint uses too), q/k/v fused into linear_qkv with Megatron's per-group
# interleave, gate and up fused into linear_fc1 ([gate; up]).
MEGATRON_GLOBAL = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
MEGATRON_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.q_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.k_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.v_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.q_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.k_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.v_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.gate_proj.weight": "mlp.linear_fc1.weight",
    "mlp.up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# Older megatron-core local-spec checkpoints keep the norms as modules of their own.
MEGATRON_NORM_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def megatron_layer_name(hf_name: str) -> tuple[int, str] | None:
    """(layer, Megatron name under decoder.layers) of a layer tensor, None for the others."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not m or m.group(2) not in MEGATRON_LAYER:
        return None
    return int(m.group(1)), MEGATRON_LAYER[m.group(2)]


def megatron_key(hf_name: str) -> str:
    """The Megatron key holding `hf_name` (layers: the stacked decoder.layers.* key)."""
    layer = megatron_layer_name(hf_name)
    if layer is not None:
        return "decoder.layers." + layer[1]
    if hf_name not in MEGATRON_GLOBAL:
        raise CheckpointError(f"tensor {hf_name!r} has no Megatron-LM name (dense GPT/LLaMA weights only)")
    return MEGATRON_GLOBAL[hf_name]


def megatron_parts(hf_name: str, model: ModelConfig) -> tuple[list[str], str]:
    """The Hugging Face tensors fused with `hf_name` in its Megatron tensor, in order, and how they are
    fused: 'qkv' (per query group: its q heads, then k, then v), 'rows' (stacked: [gate; up]) or ''."""
    prefix, _, leaf = hf_name.rpartition("self_attn.")
    if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"):
        kind = leaf.split(".")[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"], "qkv"
    prefix, _, leaf = hf_name.rpartition("mlp.")
    if leaf in ("gate_proj.weight", "up_proj.weight"):
        return [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"], "rows"
    return [hf_name], ""


def megatron_split(fused: np.ndarray, kind: str, model: ModelConfig) -> list[np.ndarray]:
    """One Megatron tensor (or an Adam moment of it: the same rows) into its Hugging Face parts."""
    if kind == "rows":
        return list(np.split(fused, 2, axis=0))
    if kind == "qkv":
        groups, per = model.num_kv_heads, model.num_heads // model.num_kv_heads
        g = fused.reshape(groups, per + 2, model.head_dim, *fused.shape[1:])
        rest = fused.shape[1:]
        return [np.ascontiguousarray(g[:, :per]).reshape(-1, *rest), np.ascontiguousarray(g[:, per]).reshape(-1, *rest),
                np.ascontiguousarray(g[:, per + 1]).reshape(-1, *rest)]
    return [fused]


def megatron_fuse(parts: list[np.ndarray], kind: str, model: ModelConfig) -> np.ndarray:
    """megatron_split's inverse."""
    if kind == "rows":
        return np.concatenate(parts, axis=0)
    if kind == "qkv":
        groups, per, hd = model.num_kv_heads, model.num_heads // model.num_kv_heads, model.head_dim
        q, k, v = (p.reshape(groups, -1, hd, *p.shape[1:]) for p in parts)
        return np.concatenate([q, k, v], axis=1).reshape(-1, *parts[0].shape[1:])
    return parts[0]
