"""Shared by the checkpoint tests: a tiny model, a reference state, slicing by the plan."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ms_llm.checkpoint import Piece, Region, optim_name, optim_pieces, param_pieces
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.init import init_param
from ms_llm.strategy.ir import ParallelStrategy

TINY = ModelConfig(name="ckpt_tiny", vocab_size=128, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                   ffn_hidden_size=128, max_seq_len=64, dtype="float32")
STATES = ("exp_avg", "exp_avg_sq")


def plan_for(strategy: dict, world: int, model: ModelConfig = TINY):
    return layout_plan(model, from_dict(ParallelStrategy, strategy, "strategy"), world)


def reference(model: ModelConfig = TINY, seed: int = 7) -> dict[str, np.ndarray]:
    """Full tensors: weights (std 1, so no two elements are equal by accident) and Adam moments."""
    p = plan_for({"dp": 1}, 1, model)
    ref = {}
    for name, pp in p.params.items():
        ref[name] = init_param("w" + name, pp.shape, seed, std=1.0)
        for i, state in enumerate(STATES):
            ref[optim_name(state, name)] = init_param(f"{state}{name}", pp.shape, seed + 1 + i, std=1.0)
    return ref


def cut(full: np.ndarray, region: Region) -> np.ndarray:
    """What a rank holding `region` of `full` has: the box, or a flat run of it."""
    box = full[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes))]
    if region.flat:
        return np.ascontiguousarray(box).reshape(-1)[region.flat[0]:region.flat[1]]
    return np.ascontiguousarray(box)


def rank_pieces(plan, rank: int) -> dict[str, Piece]:
    return param_pieces(plan, rank) | optim_pieces(plan, rank, STATES)


def as_version_1(folder: Path) -> dict:
    """Rewrite a committed folder as ms_llm wrote it before index parts (format version 1):
    every tensor's shards inside index.json, no index_*.json. Returns the index, also written."""
    index = json.loads((folder / "index.json").read_text())
    for rank in range(len(index.pop("parts"))):
        part = folder / f"index_{rank:05d}.json"
        for name, shards in json.loads(part.read_text())["tensors"].items():
            index["tensors"][name].setdefault("shards", []).extend(shards)
        part.unlink()
    index["version"] = 1
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return index
