"""Hugging Face LLaMA / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / DeepSeek-V3 export and import.

Canonical tensor names are Hugging Face names, so export is a copy: full tensors
into model-0000i-of-0000n.safetensors + model.safetensors.index.json, and a config.json
that transformers 5 reads (ms_llm/config/hf.py); routed experts are written one tensor per
expert and DeepSeek's multi-token prediction modules as model.layers.{num_layers + d}.*, or left
out (hf_moe). Import wraps the HF files as a checkpoint source (no copy; the per-expert or fused
expert tensors and the MTP layers are first staged into one file under canonical names) that
`reshard` lays out for any strategy.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.checkpoint.interop.hf_moe import export_names, import_sources, mtp_depths, stage_canonical
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import layout_plan, reshard
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.format import Index, ShardEntry, TensorEntry, split_optim_name
from ms_llm.checkpoint.storage.safetensors_io import bf16_to_f32, f32_to_bf16, read_header, storage_dtype, write_file
from ms_llm.checkpoint.storage.untrusted import confined
from ms_llm.config.hf import MIXTRAL, hf_config, model_from_hf_config, model_type_of
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError
from ms_llm.strategy.ir import ParallelStrategy

INDEX_NAME = "model.safetensors.index.json"
FP32_TENSORS = ("e_score_correction_bias",)
SINGLE_NAME = "model.safetensors"


def convert_dtype(array: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Change dtype; bfloat16 (raw uint16 bits) goes through float32 with round-to-nearest-even."""
    if src == dst:
        return array
    wide = bf16_to_f32(array) if src == "bfloat16" else array.astype(np.float32)
    return f32_to_bf16(wide) if dst == "bfloat16" else wide.astype(storage_dtype(dst))


def export_hf(src: str | Path, out: str | Path, *, dtype: Optional[str] = None,
              max_shard_bytes: int = 5 << 30, mtp: bool = True) -> Path:
    """Write the model weights of checkpoint `src` as a Hugging Face folder `out`; `mtp` False
    leaves the multi-token prediction modules out (config.json then says none)."""
    ckpt = Checkpoint.open(src)
    model = ckpt.model_config()
    try:
        hf_config(model, "float32")              # refuses a model no transformers class computes, before writing
    except CheckpointError as exc:
        raise CheckpointError(f"{ckpt.folder}: {exc}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = hf_tensors(ckpt, model, mtp)
    names = list(sources)
    out_dtype = dtype or ckpt.entry("model.embed_tokens.weight").dtype

    def dtype_of(name: str) -> str:
        """`out_dtype`, but the routers' expert bias keeps its fp32 (transformers keeps it so)."""
        return ckpt.entry(sources[name][0]).dtype if name.endswith(FP32_TENSORS) else out_dtype

    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = math.prod(hf_shape(ckpt, *sources[name])) * storage_dtype(dtype_of(name)).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = SINGLE_NAME if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        entries = [(n, dtype_of(n), hf_shape(ckpt, *sources[n])) for n in group]
        total += write_file(str(confined(out, fname, "an export file")), entries,
                            lambda n: convert_dtype(hf_read(ckpt, *sources[n]), ckpt.entry(sources[n][0]).dtype,
                                                    dtype_of(n)), {"format": "pt"})
        weight_map.update({n: fname for n in group})
    if len(groups) > 1:
        confined(out, INDEX_NAME, "an export file").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = hf_config(model, out_dtype, mtp)
    confined(out, "config.json", "an export file").write_text(json.dumps(config, indent=2))
    ckpt.close()
    return out


def hf_tensors(ckpt: Checkpoint, model: ModelConfig, mtp: bool = True) -> dict[str, tuple[str, Optional[int]]]:
    """Hub name -> (canonical tensor, expert index or None) of every model weight."""
    mixtral = model_type_of(model) == MIXTRAL
    out: dict[str, tuple[str, Optional[int]]] = {}
    for name in ckpt.names():
        if split_optim_name(name) is None:
            out.update({hub: (name, e) for hub, e in export_names(name, model, mixtral, mtp)})
    return out


def hf_shape(ckpt: Checkpoint, name: str, expert: Optional[int]) -> tuple[int, ...]:
    shape = tuple(ckpt.entry(name).shape)
    return shape if expert is None else shape[1:]


def hf_read(ckpt: Checkpoint, name: str, expert: Optional[int]) -> np.ndarray:
    """The full tensor, or one expert's slice of a stacked one."""
    if expert is None:
        return ckpt.read_full(name)
    shape = ckpt.entry(name).shape
    return ckpt.read(name, Region((expert,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])))[0]


def hf_source(folder: str | Path, staging: Optional[Path] = None) -> Checkpoint:
    """A Hugging Face folder opened as a (read-only, checksum-less) checkpoint of full tensors.
    MoE checkpoints keep one tensor per expert (or transformers 5's fused gate_up_proj) where
    ms_llm stacks them, and DeepSeek's MTP layers have other names: such weights are first written
    to `staging` under canonical names (hf_moe.stage_canonical). The model's mtp_layers is the
    number of MTP layers the weights hold (transformers' save_pretrained drops them)."""
    folder = Path(folder)
    config = _read_json(folder, "config.json")
    if (folder / INDEX_NAME).is_file():
        data = _read_json(folder, INDEX_NAME)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX_NAME}: 'weight_map' is missing or not a JSON object")
        files = sorted(set(weight_map.values()), key=str)
    elif (folder / SINGLE_NAME).is_file():
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME}; only safetensors weights import")
    tensors = _file_tensors(folder, files, f"a file in {INDEX_NAME} 'weight_map'")
    stored = {t.dtype for t in tensors.values()}
    model = model_from_hf_config(config, str(folder / "config.json"), stored.pop() if len(stored) == 1 else None)
    depths = mtp_depths(list(tensors), model.num_layers)
    if depths != model.mtp_layers:
        model = _with_mtp(model, depths, folder)
    if model.moe is not None or depths:
        if staging is None:
            raise CheckpointError(f"{folder}: its experts are one tensor each (or its MTP layers named apart); import "
                                  "it with `ms-llm convert-checkpoint HF_DIR DST --from hf`, which stacks them")
        hub = Checkpoint(folder, _index(tensors, {}))
        experts = model.moe.num_experts if model.moe is not None else 0
        stage_canonical(hub, import_sources(list(tensors), model.num_layers, experts, folder),
                        str(confined(staging, SINGLE_NAME, "the stacked experts")))
        hub.close()
        folder, tensors = staging, _file_tensors(staging, [SINGLE_NAME], "the stacked experts")
    if model.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(folder, _index(tensors, {"backend": "hf", "model": to_dict(model, full=True)}))


def _with_mtp(model: ModelConfig, depths: int, folder: Path) -> ModelConfig:
    """`model` with the MTP layers its weights hold: fewer than config.json names (none, from
    save_pretrained), or refused when config.json names fewer."""
    if depths > model.mtp_layers:
        raise CheckpointError(f"{folder}: holds {depths} layers past num_hidden_layers={model.num_layers}, but "
                              f"config.json's num_nextn_predict_layers is {model.mtp_layers}")
    return dataclasses.replace(model, mtp_layers=depths)


def _file_tensors(folder: Path, files: list[str], what: str) -> dict[str, TensorEntry]:
    """Every tensor of the safetensors `files`, each one whole shard."""
    tensors = {}
    for fname in files:
        spans, _, _ = read_header(str(confined(folder, fname, what)))
        for key, span in spans.items():
            region = Region((0,) * len(span.shape), span.shape)
            tensors[key] = TensorEntry(key, span.shape, span.dtype, "", [ShardEntry(fname, key, region, 0, ())])
    return tensors


def _index(tensors: dict[str, TensorEntry], config: dict) -> Index:
    return Index(step=0, world_size=1, config=config, state={}, rank_states={}, tensors=tensors)


def _read_json(folder: Path, name: str) -> object:
    path = confined(folder, name, name)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {name}; not a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from None


def import_hf(folder: str | Path, dst_root: str | Path, target=None) -> Path:
    """Write Hugging Face weights as an ms_llm checkpoint laid out for `target` (a ModelPlan;
    default one rank holding full tensors)."""
    dst_root = Path(dst_root)
    dst_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".hf-stacked-", dir=dst_root) as staging:
        source = hf_source(folder, Path(staging))
        target = target or layout_plan(source.model_config(), ParallelStrategy(dp=1), 1)
        return reshard(source, dst_root, target, backend="hf")
