"""The checkpoint index: one JSON file that says where every byte of every tensor lives.

    step_00000100/
      index.json                  this file
      rank_00000.safetensors      what rank 0 held (only the copies it is primary for)
      rank_00001.safetensors      (one per rank)

index.json holds the format version, the step, the run config it was saved under (model,
strategy, world size, backend), the training state (step, LR scheduler, data sampler,
loss scaler: plain JSON, identical on every rank), each rank's own state (RNG states),
and for every tensor its global shape, dtype, the layout it was saved under and its
shards: file, key in that file, region in the global tensor (boxes.Region) and CRC32s of
consecutive blocks of its bytes. Tensor names are Hugging Face LLaMA names for weights;
optimizer states are `optim.<state>.<param name>` (see `optim_name`).
"""
from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ms_llm.checkpoint.boxes import Region
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError

FORMAT = "ms_llm.checkpoint"
VERSION = 1
INDEX = "index.json"
OPTIM_PREFIX = "optim."


def optim_name(state: str, param: str) -> str:
    """Checkpoint name of optimizer state `state` (exp_avg, exp_avg_sq, master, ...) of `param`."""
    return f"{OPTIM_PREFIX}{state}.{param}"


def split_optim_name(name: str) -> Optional[tuple[str, str]]:
    """(state, param) for an optimizer-state name, None for a model tensor."""
    if not name.startswith(OPTIM_PREFIX):
        return None
    state, _, param = name[len(OPTIM_PREFIX):].partition(".")
    return state, param


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


@dataclass(frozen=True)
class ShardEntry:
    file: str
    key: str
    region: Region
    block: int                      # bytes per checksum block
    crc32: tuple[int, ...]          # one per block of the shard's bytes

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, **self.region.to_json(), "block": self.block,
                "crc32": list(self.crc32)}

    @classmethod
    def from_json(cls, data: dict) -> "ShardEntry":
        return cls(data["file"], data["key"], Region.from_json(data), int(data["block"]),
                   tuple(int(c) for c in data["crc32"]))


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = ""                # how it was split when saved (TensorLayout.describe), informative
    shards: list[ShardEntry] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        out = {"shape": list(self.shape), "dtype": self.dtype, "shards": [s.to_json() for s in self.shards]}
        if self.layout:
            out["layout"] = self.layout
        return out

    @classmethod
    def from_json(cls, name: str, data: dict) -> "TensorEntry":
        return cls(name, tuple(data["shape"]), data["dtype"], data.get("layout", ""),
                   [ShardEntry.from_json(s) for s in data["shards"]])


@dataclass
class Index:
    step: int
    world_size: int
    config: dict[str, Any]          # {"model": ..., "strategy": ..., "backend": ...}
    state: dict[str, Any]           # training state shared by all ranks
    rank_states: dict[int, dict[str, Any]]
    tensors: dict[str, TensorEntry]
    save_stats: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
                "config": self.config, "state": self.state, "save_stats": self.save_stats,
                "rank_states": {str(r): s for r, s in sorted(self.rank_states.items())},
                "tensors": {n: t.to_json() for n, t in sorted(self.tensors.items())}}

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Index":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not an ms_llm checkpoint index (format field missing)")
        if data.get("version") != VERSION:
            raise CheckpointError(f"{where}: format version {data.get('version')} but this ms_llm reads "
                                  f"version {VERSION}; convert it with the ms_llm that wrote it")
        try:
            return cls(int(data["step"]), int(data["world_size"]), data["config"], data["state"],
                       {int(r): s for r, s in data["rank_states"].items()},
                       {n: TensorEntry.from_json(n, t) for n, t in data["tensors"].items()},
                       data.get("save_stats", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: index is malformed ({type(exc).__name__}: {exc})") from None


def check_coverage(entry: TensorEntry, where: str) -> None:
    """Every element of the tensor is in some shard exactly once (counts, not positions:
    overlapping shards would be a writer bug the reader also tolerates)."""
    total = sum(s.region.numel for s in entry.shards)
    if total != entry.numel:
        raise CheckpointError(f"{where}: tensor {entry.name!r} has {total} elements in its shards but shape "
                              f"{entry.shape} needs {entry.numel}; a rank's shards are missing")


def encode_state(value: Any) -> Any:
    """JSON form of a state tree; bytes (RNG states) become {"__bytes__": base64}."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_state(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):          # numpy scalars
        return value.item()
    raise CheckpointError(f"training state value of type {type(value).__name__} is not JSON, bytes or a "
                          "number; store tensors as checkpoint tensors instead")


def decode_state(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value


def run_config(plan=None, backend: str = "", **extra: Any) -> dict[str, Any]:
    """The `config` section: model, strategy and world size of a ModelPlan, and the backend."""
    out: dict[str, Any] = {"backend": backend, **extra}
    if plan is not None:
        out.update(model=to_dict(plan.model, full=True), strategy=to_dict(plan.strategy, full=True),
                   world_size=plan.world_size)
    return out
