"""The safetensors file format, written and parsed here so reads can be byte ranges.

A file is an 8-byte little-endian header length N, N bytes of JSON (padded with spaces to
a multiple of 8) mapping each key to {"dtype", "shape", "data_offsets": [begin, end]}
relative to the data section, then the data, dense and in offset order. The `safetensors`
package reads what this module writes (tests check it); this module exists because the
reader must know each tensor's absolute byte offset to read only the ranges it needs,
and the writer must lay out a whole file image in one host buffer.

bfloat16 has no numpy type: it travels as uint16 arrays holding the raw bits, and the
dtype name ("bfloat16") says how to read them. `bf16_to_f32` / `f32_to_bf16` convert.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Mapping, NamedTuple

import numpy as np

from ms_llm.checkpoint.storage.untrusted import CheckedOnUse, integers, open_regular, parse_json
from ms_llm.errors import CheckpointError

# Our dtype name -> (safetensors code, numpy storage dtype).
DTYPES: dict[str, tuple[str, np.dtype]] = {
    "float64": ("F64", np.dtype("<f8")),
    "float32": ("F32", np.dtype("<f4")),
    "float16": ("F16", np.dtype("<f2")),
    "bfloat16": ("BF16", np.dtype("<u2")),
    "int64": ("I64", np.dtype("<i8")),
    "int32": ("I32", np.dtype("<i4")),
    "int16": ("I16", np.dtype("<i2")),
    "int8": ("I8", np.dtype("i1")),
    "uint64": ("U64", np.dtype("<u8")),
    "uint32": ("U32", np.dtype("<u4")),
    "uint16": ("U16", np.dtype("<u2")),
    "uint8": ("U8", np.dtype("u1")),
    "bool": ("BOOL", np.dtype("?")),
}
FROM_CODE = {code: name for name, (code, _) in DTYPES.items()}


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype arrays of dtype `name` are held in (uint16 for bfloat16)."""
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name][1]


def dtype_name(array: np.ndarray) -> str:
    """Our name for a numpy array's dtype (uint16 stays uint16; say 'bfloat16' explicitly)."""
    for name, (_, np_dtype) in DTYPES.items():
        if array.dtype == np_dtype and name != "bfloat16":
            return name
    raise CheckpointError(f"numpy dtype {array.dtype} has no checkpoint dtype; convert it to one of "
                          f"{', '.join(DTYPES)}")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of raw bfloat16 bits (uint16) to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> raw bfloat16 bits, round to nearest even (torch's rounding); NaN stays NaN."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


class TensorSpan(NamedTuple):
    """One tensor of a safetensors file: where its bytes are in the file (a NamedTuple: a load
    builds one per piece it plans)."""
    key: str
    dtype: str                      # our name
    shape: tuple[int, ...]
    start: int                      # absolute byte offset in the file
    nbytes: int


def header_bytes(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                 ) -> tuple[bytes, list[TensorSpan]]:
    """Header for tensors (key, dtype, shape) laid out in the given order, and their spans.

    Callers order entries by descending item size so every tensor starts aligned to it."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    rel = []
    for key, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * storage_dtype(dtype).itemsize
        header[key] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        rel.append((key, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, [TensorSpan(k, d, s, len(head) + o, n) for k, d, s, o, n in rel]


def read_header(path: str) -> tuple[Mapping[str, TensorSpan], dict[str, str], int]:
    """Parse a safetensors header: spans by key (each checked when first looked up), metadata,
    and the file size.

    Raises CheckpointError naming the file (and the tensor and field) when the header is
    unreadable, a value in it is not what the format allows, or a tensor's bytes lie past
    the end of the file (a truncated write)."""
    text, size = _header_text(path)
    header = parse_json(text, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is a {type(header).__name__}, not a JSON object")
    base = 8 + len(text)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: safetensors '__metadata__' is not a JSON object")
    return CheckedOnUse(header, lambda key, info: _span(path, key, info, base, size)), metadata, size


def open_shard_file(path: str) -> tuple[int, os.stat_result]:
    """A descriptor of the shard file and its fstat (untrusted.open_regular: a regular file only)."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None


def _header_text(path: str) -> tuple[bytes, int]:
    """The header JSON bytes and the file size."""
    fd, st = open_shard_file(path)
    try:
        size = st.st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes); not even a safetensors header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 << 20:
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes); "
                                  "the file is truncated or not safetensors")
        return os.pread(fd, n, 8), size
    finally:
        os.close(fd)


def _span(path: str, key: str, info: object, base: int, size: int) -> TensorSpan:
    """One header entry, every number checked against the format and the file size."""
    where = f"{path}: tensor {key!r}"
    dtype = FROM_CODE.get(info.get("dtype")) if type(info) is dict and type(info.get("dtype")) is str else None
    if dtype is None:
        raise CheckpointError(f"{where}: header entry is malformed: {info!r:.80}")
    shape = integers(info.get("shape"), where, "shape")
    begin, end = integers(info.get("data_offsets"), where, "data_offsets", length=2)
    expected = math.prod(shape) * DTYPES[dtype][1].itemsize
    if end - begin != expected:
        raise CheckpointError(f"{where}: 'data_offsets' [{begin}, {end}) hold {end - begin} bytes but shape "
                              f"{list(shape)} {dtype} needs {expected}")
    if base + end > size:
        raise CheckpointError(f"{where}: truncated: needs bytes up to {base + end} but the file has {size}")
    return TensorSpan(key, dtype, shape, base + begin, end - begin)


def write_file(path: str, entries: list[tuple[str, str, tuple[int, ...]]], fetch, metadata: dict[str, str] | None = None
               ) -> int:
    """Stream a safetensors file: header first, then `fetch(key)` (a numpy array of the entry's
    dtype and shape) for each entry in order, so only one tensor is in memory at a time.
    Returns the bytes written."""
    order = sorted(entries, key=lambda e: -storage_dtype(e[1]).itemsize)
    head, spans = header_bytes(order, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for span in spans:
            value = fetch(span.key)
            array = np.ascontiguousarray(value).reshape(np.shape(value))     # a 0-d value stays 0-d
            if array.dtype != storage_dtype(span.dtype) or tuple(array.shape) != span.shape:
                raise CheckpointError(f"{path}: tensor {span.key!r} came as {array.dtype} {array.shape}, "
                                      f"expected {span.dtype} {span.shape}")
            f.write(memoryview(array).cast("B"))
            del array, value            # before the next fetch: one tensor in memory, not two
        f.flush()
        os.fsync(f.fileno())
    return spans[-1].start + spans[-1].nbytes if spans else len(head)
