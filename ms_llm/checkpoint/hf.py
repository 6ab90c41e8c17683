"""Hugging Face LLaMA export and import.

Canonical tensor names are Hugging Face LLaMA names, so export is a copy: full tensors
into model-0000i-of-0000n.safetensors + model.safetensors.index.json, and a config.json
that transformers' LlamaForCausalLM reads. Import wraps the HF files as a checkpoint
source (no copy) that `reshard` lays out for any strategy.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.checkpoint.boxes import Region
from ms_llm.checkpoint.format import Index, ShardEntry, TensorEntry, split_optim_name
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import layout_plan, reshard
from ms_llm.checkpoint.safetensors_io import bf16_to_f32, f32_to_bf16, read_header, storage_dtype, write_file
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError
from ms_llm.strategy.ir import ParallelStrategy

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def hf_config(model: ModelConfig, dtype: str) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim, "max_position_embeddings": model.max_seq_len,
        "rope_theta": model.rope_theta, "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }


def model_from_hf_config(cfg: dict, where: str) -> ModelConfig:
    if cfg.get("model_type") != "llama":
        raise CheckpointError(f"{where}: model_type {cfg.get('model_type')!r}; only LLaMA ('llama') imports")
    try:
        return ModelConfig(
            name=cfg.get("_name_or_path", "") or "hf_llama", vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_hidden_size=cfg["intermediate_size"], max_seq_len=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=cfg.get("torch_dtype") if cfg.get("torch_dtype") in ("float32", "bfloat16", "float16") else "bfloat16")
    except KeyError as exc:
        raise CheckpointError(f"{where}: config.json lacks {exc.args[0]!r}") from None


def convert_dtype(array: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Change dtype; bfloat16 (raw uint16 bits) goes through float32 with round-to-nearest-even."""
    if src == dst:
        return array
    wide = bf16_to_f32(array) if src == "bfloat16" else array.astype(np.float32)
    return f32_to_bf16(wide) if dst == "bfloat16" else wide.astype(storage_dtype(dst))


def export_hf(src: str | Path, out: str | Path, *, dtype: Optional[str] = None,
              max_shard_bytes: int = 5 << 30) -> Path:
    """Write the model weights of checkpoint `src` as a Hugging Face folder `out`."""
    ckpt = Checkpoint.open(src)
    model = ckpt.model_config()
    if model.num_experts:
        raise CheckpointError(f"{ckpt.folder}: a mixture-of-experts model has no LlamaForCausalLM layout; "
                              "Hugging Face export covers dense LLaMA models")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in ckpt.names() if split_optim_name(n) is None]
    out_dtype = dtype or ckpt.entry(names[0]).dtype
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = math.prod(ckpt.entry(name).shape) * storage_dtype(out_dtype).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = SINGLE_NAME if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        entries = [(n, out_dtype, ckpt.entry(n).shape) for n in group]
        total += write_file(str(out / fname), entries,
                            lambda n: convert_dtype(ckpt.read_full(n), ckpt.entry(n).dtype, out_dtype),
                            {"format": "pt"})
        weight_map.update({n: fname for n in group})
    if len(groups) > 1:
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(model, out_dtype), indent=2))
    ckpt.close()
    return out


def hf_source(folder: str | Path) -> Checkpoint:
    """A Hugging Face folder opened as a (read-only, checksum-less) checkpoint of full tensors."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no config.json; not a Hugging Face model folder") from None
    model = model_from_hf_config(cfg, str(folder / "config.json"))
    if (folder / INDEX_NAME).is_file():
        files = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
    elif (folder / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME}; only safetensors weights import")
    tensors = {}
    for fname in files:
        spans, _, _ = read_header(str(folder / fname))
        for key, span in spans.items():
            region = Region((0,) * len(span.shape), span.shape)
            tensors[key] = TensorEntry(key, span.shape, span.dtype, "", [ShardEntry(fname, key, region, 0, ())])
    if model.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    index = Index(step=0, world_size=1, config={"backend": "hf", "model": to_dict(model, full=True)},
                  state={}, rank_states={}, tensors=tensors)
    return Checkpoint(folder, index)


def import_hf(folder: str | Path, dst_root: str | Path, target=None) -> Path:
    """Write Hugging Face weights as an ms_llm checkpoint laid out for `target` (a ModelPlan;
    default one rank holding full tensors)."""
    source = hf_source(folder)
    target = target or layout_plan(source.model_config(), ParallelStrategy(dp=1), 1)
    return reshard(source, dst_root, target, backend="hf")
