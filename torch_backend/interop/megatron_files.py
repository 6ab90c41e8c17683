"""The files of a Megatron-LM checkpoint, read without running a peer's code and written one chunk at a
time: torch pickles through torch.load(weights_only=True), a torch_dist DCP folder read region by
region (only the chunks a region meets are loaded) and written from chunks produced on demand.

megatron-core's pickles hold argparse Namespaces, numpy arrays (RNG states) and its own enums; the
enums read as their values (PeerValue), so nothing of megatron is imported, and any other class is one
CheckpointError naming it.
"""
from __future__ import annotations

import argparse
import io
import pickle
import re
import types
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path, PosixPath
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _create_file_view

from ms_llm.checkpoint.storage.untrusted import confined
from ms_llm.errors import CheckpointError
from torch_backend.dcp import SafeDcpReader, StreamingWriter


class PeerValue:
    """A Megatron enum member as a pickle holds it: its value, without importing megatron."""

    def __init__(self, value: Any = None):
        self.value = value

    def __repr__(self) -> str:
        return f"PeerValue({self.value!r})"


MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                  "megatron.core.enums.ModelType", "megatron.core.rerun_state_machine.RerunDiagnostic",
                  "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState")
SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace, PosixPath, np.core.multiarray._reconstruct, np.ndarray,
                np.dtype, np.dtypes.UInt32DType, *[(PeerValue, name) for name in MEGATRON_ENUMS]]


def unpickle(source: Path | bytes | io.IOBase, where: str, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) of a file, bytes or a file view, allowing only SAFE_GLOBALS; one line on refusal."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            target = io.BytesIO(source) if isinstance(source, bytes) else source if hasattr(source, "read") \
                else str(source)
            return torch.load(target, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"refers to {found.group(1)}, " if found else "holds an object "
        raise CheckpointError(f"{where}: the pickle {what}which torch.load(weights_only=True) refuses; ms_llm runs "
                              "no code from a checkpoint") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{where}: not a readable torch file ({first}); truncated or damaged?") from None


def single(value: Any, where: str) -> Any:
    """megatron-core stores a ShardedObject as the list of its shards' data: the one it holds."""
    if not isinstance(value, list) or len(value) != 1:
        raise CheckpointError(f"{where}: expected megatron-core's one-element object list, got {type(value).__name__}")
    return value[0]


class DistFolder:
    """A torch_dist folder's DCP entries: tensors read by region, objects by key."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        meta = SafeDcpReader(str(folder)).read_metadata()      # checks every byte range first
        self.tensors = {k: m for k, m in meta.state_dict_metadata.items()
                        if isinstance(m, dcp_metadata.TensorStorageMetadata)}
        self.objects = {k for k, m in meta.state_dict_metadata.items() if k not in self.tensors}
        self.storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): info
                        for i, info in meta.storage_data.items()}

    def has_tensor(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def boundaries(self, key: str) -> set[int]:
        """Where the stored chunks of a 1-d tensor start and end."""
        return {b for c in self.tensors[key].chunks for b in (c.offsets[0], c.offsets[0] + c.sizes[0])}

    def layer(self, key: str, layer: Optional[int]) -> torch.Tensor:
        """A tensor, or one layer of a tensor stacked over layers."""
        shape = self.shape(key)
        if layer is None:
            return self.read(key, (0,) * len(shape), shape)
        return self.read(key, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]))[0]

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of tensor `key`, from the chunks that meet it."""
        m = self.tensors[key]
        if any(tuple(c.offsets) == tuple(offsets) and tuple(c.sizes) == tuple(sizes) for c in m.chunks):
            data = self._load(self.storage.get((key, tuple(offsets))), f"tensor {key!r} chunk {list(offsets)}")
            if not isinstance(data, torch.Tensor) or list(data.shape) != list(sizes):
                raise CheckpointError(f"{self.folder}: tensor {key!r} chunk {list(offsets)} holds "
                                      f"{getattr(data, 'shape', type(data).__name__)}, not {list(sizes)}")
            return data                     # the stored chunk is the box: no copy into another tensor
        out = torch.empty(sizes, dtype=m.properties.dtype)
        covered = 0
        for chunk in m.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            data = self._load(self.storage.get((key, tuple(chunk.offsets))), f"tensor {key!r} chunk "
                              f"{list(chunk.offsets)}")
            if not isinstance(data, torch.Tensor) or list(data.shape) != list(chunk.sizes):
                raise CheckpointError(f"{self.folder}: tensor {key!r} chunk {list(chunk.offsets)} holds "
                                      f"{getattr(data, 'shape', type(data).__name__)}, not {list(chunk.sizes)}")
            dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))
            src = tuple(slice(l - c, h - c) for l, h, c in zip(lo, hi, chunk.offsets))
            out[dst] = data[src]
            covered += out[dst].numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.folder}: the chunks of tensor {key!r} do not cover {list(offsets)} + "
                                  f"{list(sizes)}")
        return out

    def obj(self, key: str) -> Any:
        return self._load(self.storage.get((key, None)), f"object {key!r}")

    def _load(self, info, what: str) -> Any:
        if info is None:
            raise CheckpointError(f"{self.folder}/.metadata: {what} has no storage entry")
        if info.transform_descriptors:
            raise CheckpointError(f"{self.folder}: {what} is stored transformed ({info.transform_descriptors}); "
                                  "ms_llm reads plain torch_dist files")
        path = confined(self.folder, info.relative_path, f"the file of {what}")
        with open(path, "rb") as f:             # loaded from a view of its bytes: no copy of them first
            return unpickle(_create_file_view(f, info.offset, info.length), f"{path} ({what})")


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a DCP tensor to write: the tensor's key, global size and dtype, the chunk's
    offsets (None: the whole tensor) and how to produce its data when the writer reaches it."""
    key: str
    size: tuple[int, ...]
    dtype: torch.dtype
    offsets: Optional[tuple[int, ...]]
    make: Callable[[], torch.Tensor]


class _ChunkPlanner(DefaultSavePlanner):
    """Writes the chunks and objects it is given; each chunk is produced only when StreamingWriter
    reaches it, so one chunk is in memory at a time."""

    def __init__(self, chunks: list[TensorChunk], objects: dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {}
        items = []
        for c in chunks:
            offsets = c.offsets or (0,) * len(c.size)
            sizes = (1, *c.size[1:]) if c.offsets else c.size
            index = dcp_metadata.MetadataIndex(c.key, torch.Size(offsets))
            self.chunks[(c.key, offsets)] = c
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=dcp_metadata.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                properties=dcp_metadata.TensorProperties(dtype=c.dtype), size=torch.Size(c.size))))
        self.objects = objects
        items += [WriteItem(index=dcp_metadata.MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in objects]
        self.items = items

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], data)
            data.seek(0)
            return data
        c = self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = c.make().to(c.dtype).contiguous()
        want = tuple(write_item.tensor_data.chunk.sizes)
        if tuple(t.shape) != want:
            raise CheckpointError(f"export: chunk of {c.key!r} came out {list(t.shape)}, expected {list(want)}")
        return t


def write_dist(folder: Path, chunks: list[TensorChunk], objects: dict[str, Any]) -> None:
    """A one-process DCP folder of `chunks` and `objects` (each object stored as torch.save bytes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({}, storage_writer=StreamingWriter(str(folder)), planner=_ChunkPlanner(chunks, objects), no_dist=True)
