"""Hugging Face (ms_llm) tensor names <-> those of MindFormers 2.x's dense models (use_legacy: False:
TeleChat3ForCausalLM, Qwen3ForCausalLM, the models `convert-strategy --to mindformers2` writes).

The network's parameters carry the Hugging Face name through the class's weight_mapping
(ModelMixin.convert_name; no `model.` prefix: the model cell is built with auto_prefix=False), and
two fused groups, as ModelMixin.convert_weight_dict builds them:
    linear_qkv: per query group, its q rows, then its k rows, then its v rows: (groups, (heads / groups + 2)
        * head_dim, ...) flattened (concat_qkv_weight_megatron, QKVConvertOp); the biases likewise.
    linear_fc1: gate and up rows interleaved, row 2i gate_i and 2i+1 up_i (concat_ffn_weight_megatron;
        MLPInterleaved reshapes its output to (..., ffn, 2)).
A dim-0 slice of a fused tensor over whole query groups (whole rows) is what a model-parallel rank
holds, so the whole tensor reshards to any model_parallel.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import numpy as np

from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError

TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "lm_head.weight": "output_layer.weight",
       "model.norm.weight": "decoder.final_layernorm.weight"}
LAYER = {"input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight":
         "pre_mlp_layernorm.weight", "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
         "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
         "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
         "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
# fused MindFormers name -> the Hugging Face names it holds, in its order
FUSED = {"self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
         "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
         "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
_PART = {hf: (fused, i) for fused, parts in FUSED.items() for i, hf in enumerate(parts)}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MF_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def check_model(model: ModelConfig) -> None:
    """The 2.x writer covers the dense grouped-query models; say which field is outside it."""
    for field, value in (("mla", model.mla), ("moe", model.moe), ("mtp_layers", model.mtp_layers)):
        if value:
            raise CheckpointError(f"model.{field}: the MindFormers 2.x checkpoint export writes dense grouped-query "
                                  "models (TeleChat3ForCausalLM, Qwen3ForCausalLM); export this one with --to hf")


def mcore_name(name: str) -> tuple[str, int]:
    """The MindFormers 2.x network name holding Hugging Face tensor `name`, and its part (0 for an
    unfused tensor, else its place in FUSED)."""
    if name in TOP:
        return TOP[name], 0
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in LAYER:
        return f"decoder.layers.{m.group(1)}.{LAYER[m.group(2)]}", 0
    if m and m.group(2) in _PART:
        fused, part = _PART[m.group(2)]
        return f"decoder.layers.{m.group(1)}.{fused}", part
    raise CheckpointError(f"tensor {name!r} has no name in MindFormers 2.x's dense models")


def part_count(name: str) -> int:
    """How many Hugging Face tensors the 2.x network tensor `name` holds."""
    m = _MF_LAYER.fullmatch(name)
    return len(FUSED[m.group(2)]) if m and m.group(2) in FUSED else 1


def hf_parts(name: str) -> Optional[tuple[str, ...]]:
    """The Hugging Face names a MindFormers 2.x network tensor holds (one unless fused); None when
    `name` is not one of theirs."""
    if name in TOP.values():
        return next(k for k, v in TOP.items() if v == name),
    m = _MF_LAYER.fullmatch(name)
    if m is None:
        return None
    layer, rest = m.groups()
    if rest in FUSED:
        return tuple(f"model.layers.{layer}.{p}" for p in FUSED[rest])
    hf = next((k for k, v in LAYER.items() if v == rest), None)
    return (f"model.layers.{layer}.{hf}",) if hf else None


def _qkv_rows(model: ModelConfig) -> tuple[int, int, int]:
    """(query groups, q rows per group, k = v rows per group)."""
    heads, groups = model.num_heads, model.num_kv_heads or model.num_heads
    dim = model.head_dim or model.hidden_size // model.num_heads
    return groups, heads // groups * dim, dim


def fuse(fused: str, parts: list[np.ndarray], model: ModelConfig) -> np.ndarray:
    """MindFormers' fused tensor from its Hugging Face parts (in FUSED order)."""
    if fused.endswith("mlp.linear_fc1.weight"):
        gate, up = parts
        return np.stack([gate, up], axis=1).reshape((-1,) + gate.shape[1:])
    groups = _qkv_rows(model)[0]
    tail = parts[0].shape[1:]
    return np.concatenate([p.reshape((groups, -1) + tail) for p in parts], axis=1).reshape((-1,) + tail)


def split(fused: str, value: np.ndarray, model: ModelConfig, where: str) -> list[np.ndarray]:
    """The Hugging Face parts of a fused MindFormers tensor (inverse of `fuse`)."""
    tail = value.shape[1:]
    if fused.endswith("mlp.linear_fc1.weight"):
        if value.shape[0] != 2 * model.ffn_hidden_size:
            raise CheckpointError(f"{where}: {fused!r} has {value.shape[0]} rows; the model's gate and up give "
                                  f"2 x {model.ffn_hidden_size}")
        pairs = value.reshape((model.ffn_hidden_size, 2) + tail)
        return [np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])]
    groups, q, kv = _qkv_rows(model)
    if value.shape[0] != groups * (q + 2 * kv):
        raise CheckpointError(f"{where}: {fused!r} has {value.shape[0]} rows; the model's {model.num_heads} heads in "
                              f"{groups} groups of head_dim {kv} give {groups * (q + 2 * kv)}")
    g = value.reshape((groups, q + 2 * kv) + tail)
    bounds = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
    return [np.ascontiguousarray(g[:, a:b]).reshape((-1,) + tail) for a, b in bounds]


def part_shape(hf: str, fused_shape: tuple[int, ...], model: ModelConfig) -> tuple[int, ...]:
    """The shape of Hugging Face tensor `hf` inside a fused tensor of `fused_shape`."""
    tail = tuple(fused_shape[1:])
    if "mlp." in hf:
        return (model.ffn_hidden_size,) + tail
    groups, q, kv = _qkv_rows(model)
    return (groups * (q if ".q_proj." in hf else kv),) + tail


def part_reader(fused: str, index: int, read: Callable[[], np.ndarray], model: ModelConfig,
                where: str) -> Callable[[], np.ndarray]:
    return lambda: split(fused, read(), model, where)[index]
