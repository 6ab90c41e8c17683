"""torch side of ms_llm checkpoints: local tensors <-> numpy, optimizer states.

The format, the writer and the reader are ms_llm.checkpoint (shared with MindSpore); this
module only pairs torch tensors with the plan's Pieces:

    items = save_items(param_pieces(plan, rank), named_local_tensors)
    writer.save(step, items, ...)
    load_into(Checkpoint.open(root, rank), param_pieces(plan, rank), named_local_tensors)

A DTensor contributes its local shard (`to_local()`); the plan says where that shard sits.
Device tensors are copied straight into the writer's host buffer by a copy function.
DCP export/import (torch.distributed.checkpoint) is torch_backend/dcp.py.
"""
from __future__ import annotations


import numpy as np
import torch

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.writer import SaveItem, held_items
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
