"""torch side of ms_llm checkpoints: local tensors <-> numpy, optimizer states, DCP bridge.

The format, the writer and the reader are ms_llm.checkpoint (shared with MindSpore); this
module only pairs torch tensors with the plan's Pieces:

    items = save_items(param_pieces(plan, rank), named_local_tensors)
    writer.save(step, items, ...)
    load_into(Checkpoint.open(root, rank), param_pieces(plan, rank), named_local_tensors)

A DTensor contributes its local shard (`to_local()`); the plan says where that shard sits.
Device tensors are copied straight into the writer's host buffer by a copy function.
DCP export/import (torch.distributed.checkpoint) lets torchtitan users move over.
"""
from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader

from ms_llm.checkpoint.interop import names as name_tables
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import write_full
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage.format import split_optim_name
from ms_llm.checkpoint.storage.untrusted import confined, integer, integers
from ms_llm.checkpoint.writer import SaveItem, held_items
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
               torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
# Same-width integer views: numpy has no bfloat16, so its bits travel as int16/uint16.
_BITS = {torch.bfloat16: torch.int16}


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local tensor), detached."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Host numpy of a local tensor (a view for CPU tensors); bfloat16 as its uint16 bits."""
    t = local(t).cpu()
    if t.dtype in _BITS:
        return t.view(_BITS[t.dtype]).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    """torch tensor sharing `array`'s memory, read as checkpoint dtype `dtype`."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype == "bfloat16":
        return t.view(torch.int16).view(torch.bfloat16)
    return t


def save_items(pieces: dict[str, Piece], tensors: dict[str, torch.Tensor]) -> list[SaveItem]:
    """SaveItems for every piece (writer.held_items); `tensors` maps the same names to local tensors."""
    return held_items(pieces, tensors, _save_item)


def _save_item(piece: Piece, tensor: torch.Tensor) -> SaveItem:
    """The item of a piece this rank saves: its local tensor, copied straight into the snapshot."""
    t = local(tensor)
    if tuple(t.shape) != piece.local_shape:
        raise CheckpointError(f"{piece.name}: local tensor {tuple(t.shape)} does not match its planned piece "
                              f"{piece.local_shape}; the model was not laid out by this plan")
    if t.dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{piece.name}: dtype {t.dtype} cannot be checkpointed")
    return SaveItem(piece, _copier(t), DTYPE_NAMES[t.dtype])


def _copier(t: torch.Tensor):
    src = t.view(_BITS[t.dtype]) if t.dtype in _BITS else t

    def copy(dst: np.ndarray) -> None:
        target = torch.from_numpy(dst)
        target.copy_(src.view(target.dtype) if src.dtype != target.dtype else src)
    return copy


@torch.no_grad()
def load_into(ckpt: Checkpoint, pieces: dict[str, Piece], tensors: dict[str, torch.Tensor],
              strict: bool = True) -> list[str]:
    """Copy each piece from `ckpt` into the matching local tensor (converting dtype when the
    checkpoint's differs, e.g. fp32 weights into bf16 parameters). Returns the names loaded."""
    direct = {}                              # CPU tensors of the saved dtype are read into in place
    for name in pieces:
        dst = local(tensors[name]) if name in tensors else None
        if (dst is not None and name in ckpt.index.tensors and dst.device.type == "cpu" and dst.is_contiguous()
                and DTYPE_NAMES.get(dst.dtype) == ckpt.entry(name).dtype):
            direct[name] = to_numpy(dst)
    arrays = ckpt.read_pieces(pieces, strict=strict, out=direct)
    for name, array in arrays.items():
        if name in direct:
            continue
        dst = local(tensors[name])
        src = from_numpy(array, ckpt.entry(name).dtype)
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointError(f"{name}: local tensor {tuple(dst.shape)} but the piece read is "
                                  f"{tuple(src.shape)}")
        dst.copy_(src.to(dst.dtype))
    return sorted(arrays)


# ---- torch DCP bridge ------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this reads it allowing only DCP's metadata classes, torch
    dtypes / Size / layout and paths (the same idea as torch.load(weights_only=True))."""
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and hasattr(dcp_metadata, name):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a checkpoint never needs; "
                              "refusing to load it")


class SafeDcpReader(FileSystemReader):
    """FileSystemReader whose metadata load cannot run arbitrary code; tensor data is read by
    DCP itself with torch.load(weights_only=True)."""

    def read_metadata(self, *args, **kwargs):
        path = confined(self.path, ".metadata", "the DCP metadata file")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no .metadata; not a DCP checkpoint folder") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: not readable DCP metadata ({type(exc).__name__}: {exc})") from None
        _check_storage(Path(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage(folder: Path, metadata) -> None:
    """Before DCP opens anything: every storage file it names lies inside `folder` and holds the
    byte range claimed, and every tensor's size is non-negative and no larger than the bytes
    stored for it (so no allocation is sized by the metadata alone)."""
    stored: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        fqn = getattr(index, "fqn", str(index))
        where = f"{folder}/.metadata: storage of {fqn!r}"
        path = confined(folder, info.relative_path, f"the storage file of {fqn!r}")
        size = path.stat().st_size if path.is_file() else 0
        offset, length = integer(info.offset, where, "offset"), integer(info.length, where, "length")
        if offset + length > size:
            raise CheckpointError(f"{where}: bytes [{offset}, {offset + length}) but {path.name} has {size}")
        stored[fqn] = stored.get(fqn, 0) + length
    for key, m in metadata.state_dict_metadata.items():
        if isinstance(m, dcp_metadata.TensorStorageMetadata):
            shape = integers(list(m.size), f"{folder}/.metadata: tensor {key!r}", "size")
            nbytes = math.prod(shape) * m.properties.dtype.itemsize
            if nbytes > stored.get(key, 0):
                raise CheckpointError(f"{folder}/.metadata: tensor {key!r} of size {list(shape)} needs {nbytes} "
                                      f"bytes but {stored.get(key, 0)} are stored for it")


def export_dcp(src: str | Path, out: str | Path, names: str = "hf") -> Path:
    """Write checkpoint `src` as a DCP folder of full tensors (DCP reshards on load).
    names='hf': every tensor under its ms_llm name, optimizer states included;
    names='torchtitan': model weights only, renamed and rotary-permuted for torchtitan's LLaMA."""
    ckpt = Checkpoint.open(src)
    state_dict = {}
    for name in ckpt.names():
        array, dtype = ckpt.read_full(name), ckpt.entry(name).dtype
        if names == "torchtitan":
            if split_optim_name(name):
                continue
            name, array = name_tables.to_torchtitan(name, array, ckpt.model_config())
        state_dict[name] = from_numpy(array, dtype)
    ckpt.close()
    with warnings.catch_warnings():          # single process on purpose: full tensors, no group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return Path(out)


def dcp_source(folder: str | Path, model: ModelConfig, names: str = "hf") -> dict[str, tuple[np.ndarray, str]]:
    """Full tensors of a DCP folder under ms_llm names, with their checkpoint dtypes."""
    reader = SafeDcpReader(str(folder))
    meta = reader.read_metadata()
    state_dict = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                  for k, m in meta.state_dict_metadata.items() if isinstance(m, dcp_metadata.TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state_dict, storage_reader=reader, no_dist=True)
    out = {}
    for key, t in state_dict.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{folder}: tensor {key!r} has dtype {t.dtype}, which ms_llm cannot store")
        array = to_numpy(t)
        if names == "torchtitan":
            key, array = name_tables.from_torchtitan(key, array, model)
        out[key] = (array, DTYPE_NAMES[t.dtype])
    return out


def import_dcp(folder: str | Path, dst_root: str | Path, model: ModelConfig, names: str = "hf",
               step: int = 0) -> Path:
    """Write a DCP folder as a one-rank ms_llm checkpoint of full tensors (loadable under any
    layout; `reshard` writes it out for a strategy if wanted)."""
    return write_full(dcp_source(folder, model, names), dst_root, model, step=step, backend="torch")
