"""torch DCP (torch.distributed.checkpoint) <-> ms_llm checkpoints, so torchtitan users move over.

A module apart from torch_backend/checkpoint.py because importing DCP loads DTensor (half a
second) in every training worker, which only the convert-checkpoint command needs.
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
from ms_llm.checkpoint.storage.format import split_optim_name
from ms_llm.checkpoint.storage.untrusted import confined, integer, integers
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError
from torch_backend.checkpoint import DTYPE_NAMES, from_numpy, to_numpy


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
