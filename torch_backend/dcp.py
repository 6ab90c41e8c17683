"""torch DCP (torch.distributed.checkpoint) <-> ms_llm checkpoints, so torchtitan users move over.

A module apart from torch_backend/checkpoint.py because importing DCP loads DTensor (half a
second) in every training worker, which only the convert-checkpoint command needs.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemReader, FileSystemWriter, _write_item
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from ms_llm.checkpoint.interop import names as name_tables
from ms_llm.checkpoint.interop.run_state import LazyTensor
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import write_full
from ms_llm.checkpoint.storage.format import split_optim_name
from ms_llm.checkpoint.storage.untrusted import confined, integer, integers
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError
from torch_backend.checkpoint import DTYPE_NAMES, TORCH_DTYPES, from_numpy, to_numpy


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this reads it allowing only DCP's metadata classes, torch
    dtypes / Size / layout and paths (the same idea as torch.load(weights_only=True))."""
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("collections", "OrderedDict")}

    # DCP's save plans, which megatron-core's writer keeps in the metadata (all_local_plans).
    PLANS = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" and hasattr(dcp_metadata, name):
            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.planner" and name in self.PLANS:
            return getattr(dcp_planner, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a checkpoint never needs; "
                              "refusing to load it")


class SafeDcpReader(FileSystemReader):
    """FileSystemReader whose metadata load cannot run arbitrary code; tensor data is read by
    DCP itself with torch.load(weights_only=True). The checked metadata is kept, so reading a
    folder entry by entry (DcpEntries) parses and checks it once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._checked = None

    def read_metadata(self, *args, **kwargs):
        if self._checked is not None:
            self._checked.storage_meta.load_id = self.load_id
            return self._checked
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
        self._checked = metadata
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (ints, floats, the bytes a peer stores) read by
    torch.load(weights_only=True): DefaultLoadPlanner unpickles them with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"value {fqn!r} is not a plain value torch.load(weights_only=True) accepts "
                                  f"({first})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class DcpEntries:
    """One DCP folder read an entry at a time: a tensor is loaded whole (DCP assembles the ranks'
    chunks) only when asked for, so a conversion holds one tensor, never the state."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.reader = SafeDcpReader(str(folder))
        self.metadata = self.reader.read_metadata()
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            k: (tuple(m.size), m.properties.dtype) for k, m in self.metadata.state_dict_metadata.items()
            if isinstance(m, dcp_metadata.TensorStorageMetadata)}

        self.storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): info
                        for i, info in self.metadata.storage_data.items()}

    def has(self, key: str) -> bool:
        return key in self.metadata.state_dict_metadata

    def read(self, key: str) -> Any:
        """Tensor or value `key`; a damaged or unsafe entry is one CheckpointError naming it."""
        m = self.metadata.state_dict_metadata.get(key)
        if m is None:
            raise CheckpointError(f"{self.folder}/.metadata: has no entry {key!r}")
        whole = self._whole(key, m)
        if whole is not None:
            return whole
        target = {key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                  if isinstance(m, dcp_metadata.TensorStorageMetadata) else None}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(target, storage_reader=self.reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as exc:
            inner = next(iter(exc.failures.values()))[0]
            if isinstance(inner, CheckpointError):
                raise CheckpointError(f"{self.folder}: {inner}") from None
            first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
            raise CheckpointError(f"{self.folder}: entry {key!r} cannot be read ({type(inner).__name__}: {first})"
                                  ) from None
        return target[key]

    def _whole(self, key: str, m) -> Optional[torch.Tensor]:
        """A tensor stored whole in one plain item, loaded straight from its bytes (dcp.load loads it
        and copies it into a target: the tensor twice); None for any other layout."""
        if not isinstance(m, dcp_metadata.TensorStorageMetadata) or len(m.chunks) != 1:
            return None
        chunk = m.chunks[0]
        info = self.storage.get((key, tuple(chunk.offsets)))
        if any(chunk.offsets) or tuple(chunk.sizes) != tuple(m.size) or info is None or info.transform_descriptors:
            return None
        path = confined(self.folder, info.relative_path, f"the storage file of {key!r}")
        try:
            with open(path, "rb") as f:
                t = torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(f"{self.folder}: entry {key!r} cannot be read ({type(exc).__name__}: {first})"
                                  ) from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(m.size) or t.dtype != m.properties.dtype:
            raise CheckpointError(f"{path}: entry {key!r} holds {getattr(t, 'shape', type(t).__name__)} "
                                  f"{getattr(t, 'dtype', '')}, not {list(m.size)} {m.properties.dtype} as .metadata "
                                  "says")
        return t


class _StreamedSavePlanner(DefaultSavePlanner):
    """The state dict holds meta tensors; each is read from its LazyTensor when DCP writes it."""

    def __init__(self, lazy: dict[str, LazyTensor]):
        super().__init__()
        self.lazy = lazy

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn in self.lazy:
            return from_numpy(self.lazy[fqn].read(), self.lazy[fqn].dtype)
        return super().resolve_data(write_item)


class StreamingWriter(FileSystemWriter):
    """FileSystemWriter that writes a rank's items into its one file one at a time and keeps none:
    torch 2.13's serial writer keeps every tensor of a file until the file is closed (a dict it
    fills for its safetensors format), so a conversion through it held the whole state. The
    bytes and offsets are DCP's own (its _write_item), so any DCP reader loads the folder."""

    def write_data(self, plan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = data.detach().cpu()
                    if data.untyped_storage().nbytes() != data.nbytes:    # a view: torch.save writes its storage
                        data = data.clone()
                results.append(_write_item(self.transforms, stream, data, item, name, self.serialization_format))
                del data                                                  # before the next item is read
            if self.sync_files:
                os.fsync(stream.fileno())
        done: Future = Future()
        done.set_result(results)
        return done


def save_streamed(entries: dict[str, LazyTensor | Any], out: str | Path) -> Path:
    """A one-process DCP folder of whole tensors (LazyTensors, each read when StreamingWriter
    reaches it and dropped once written) and plain values; DCP reshards it on load under any
    world size."""
    lazy = {k: v for k, v in entries.items() if isinstance(v, LazyTensor)}
    state = {k: torch.empty(v.shape, dtype=TORCH_DTYPES[v.dtype], device="meta") if k in lazy else v
             for k, v in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=StreamingWriter(str(out)), planner=_StreamedSavePlanner(lazy), no_dist=True)
    return Path(out)


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
