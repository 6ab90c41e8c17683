"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx), byte for byte, in numpy.

PREFIX.bin holds every document's tokens back to back. PREFIX.idx, all little endian:

    b"MMIDIDX\\x00\\x00"      9 bytes magic
    version                  uint64, 1
    dtype code               uint8 (Megatron's DType: uint8 1, int8 2, int16 3, int32 4,
                             int64 5, float64 6, float32 7, uint16 8)
    sequence count  N        uint64
    document count  D        uint64 (= documents + 1: the document index starts with 0)
    sequence lengths         int32[N]
    sequence pointers        int64[N]  byte offset of each sequence in .bin
    document indices         int64[D]  sequence index where each document ends, after a 0
    (sequence modes          int8[N]   multimodal files only; ignored here)

Megatron's GPTDataset works on sequences; our writer stores one sequence per document, so the
two counts agree for files we write. Files megatron-core wrote with several sequences per
document read as their sequences, as megatron-core's own GPTDataset reads them.
"""
from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from types import TracebackType

import numpy as np

from ms_llm.durable import fsync_dir
from ms_llm.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8        # 34
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7,
               np.dtype(np.uint16): 8}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's rule (DType.optimal_dtype): uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin/.idx; nothing appears under a final name until finalize.

    Tokens go to a temporary .bin as they come (memory stays at 4 bytes per document); finalize
    writes the .idx beside it, fsyncs both, then renames .bin and last .idx, so a reader never
    sees an .idx without its complete .bin.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype not in DTYPE_CODES or self.dtype.kind not in "iu":
            raise ConfigError(f"indexed dataset {self.prefix}: token dtype {self.dtype} is not an integer type "
                              "Megatron's format supports; use uint16 (vocab < 65500) or int32")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._tmp_bin = Path(f"{bin_path(self.prefix)}{tag}")
        self._tmp_idx = Path(f"{idx_path(self.prefix)}{tag}")
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = array("i")                   # int32 lengths, as the .idx stores them
        self._limits = np.iinfo(self.dtype)

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (one sequence); ids must fit the dtype (checked, never wrapped)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise ConfigError(f"indexed dataset {self.prefix}: a document is a 1-D array of integer token ids, "
                              f"got shape {tokens.shape} dtype {tokens.dtype}")
        if tokens.size and (int(tokens.min()) < self._limits.min or int(tokens.max()) > self._limits.max):
            raise ConfigError(f"indexed dataset {self.prefix}: token ids {int(tokens.min())}..{int(tokens.max())} "
                              f"do not fit {self.dtype}; write with int32 (a vocabulary of 65500 or more)")
        if tokens.size > np.iinfo(np.int32).max:
            raise ConfigError(f"indexed dataset {self.prefix}: a document of {tokens.size} tokens exceeds "
                              "the format's int32 length; split it")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(tokens.size)

    def finalize(self) -> tuple[Path, Path]:
        """Write the .idx, make both files durable, then publish them: returns (bin, idx)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", sizes.size))
            f.write(struct.pack("<Q", sizes.size + 1))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(sizes.size + 1, dtype="<i8").tobytes())   # one sequence per document
            f.flush()
            os.fsync(f.fileno())
        final_bin, final_idx = bin_path(self.prefix), idx_path(self.prefix)
        os.replace(self._tmp_bin, final_bin)
        os.replace(self._tmp_idx, final_idx)
        fsync_dir(final_idx.parent)
        return final_bin, final_idx

    def abort(self) -> None:
        """Drop the temporaries (a failed or interrupted write leaves nothing behind)."""
        self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader; every inconsistency is a ConfigError naming the file."""

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        idx, binf = idx_path(prefix), bin_path(prefix)
        for path in (idx, binf):
            if not path.is_file():
                raise ConfigError(f"indexed dataset: {path} does not exist; a dataset is PREFIX.bin + PREFIX.idx "
                                  "(ms-llm prepare-data writes both); check the prefix")
        with open(idx, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
            raise ConfigError(f"indexed dataset: {idx} is not a Megatron .idx file (bad magic); "
                              "rebuild it with ms-llm prepare-data")
        version, code, n, d = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise ConfigError(f"indexed dataset: {idx} has format version {version}, only {VERSION} is supported")
        if code not in CODE_DTYPES:
            raise ConfigError(f"indexed dataset: {idx} has unknown dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        plain = HEADER_BYTES + 12 * n + 8 * d
        idx_bytes = idx.stat().st_size
        if idx_bytes not in (plain, plain + n):          # + n: multimodal files carry int8 modes
            raise ConfigError(f"indexed dataset: {idx} has {idx_bytes} bytes, its header ({n} sequences, "
                              f"{d} document entries) needs {plain}; the file is truncated or corrupt")
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(index, dtype="<i4", count=n, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(index, dtype="<i8", count=n, offset=HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(index, dtype="<i8", count=d, offset=HEADER_BYTES + 12 * n)
        self._check_against_bin(idx, binf)
        itemsize = self.dtype.itemsize
        self.tokens = (np.memmap(binf, dtype=self.dtype, mode="r") if binf.stat().st_size
                       else np.zeros(0, self.dtype))
        self.starts = self.pointers // itemsize         # token offset of each sequence

    def _check_against_bin(self, idx: Path, binf: Path) -> None:
        """Catches an .idx paired with another dataset's .bin, or a .bin cut short."""
        n, itemsize = self.sizes.size, self.dtype.itemsize
        expect = np.zeros(n, dtype=np.int64)
        np.cumsum(self.sizes[:-1].astype(np.int64) * itemsize, out=expect[1:])
        total = int(self.sizes.astype(np.int64).sum()) * itemsize
        bin_bytes = binf.stat().st_size
        if (self.sizes < 0).any() or not np.array_equal(self.pointers, expect):
            raise ConfigError(f"indexed dataset: {idx} has sequence pointers that do not follow its lengths; "
                              "the file is corrupt, rebuild it")
        if (self.document_indices.size == 0 or self.document_indices[0] != 0
                or self.document_indices[-1] != n or (np.diff(self.document_indices) < 0).any()):
            raise ConfigError(f"indexed dataset: {idx} has a document index that does not cover its {n} sequences; "
                              "the file is corrupt, rebuild it")
        if total != bin_bytes:
            raise ConfigError(f"indexed dataset: {idx} describes {total} bytes of {self.dtype} tokens but {binf} "
                              f"has {bin_bytes}; the .idx does not match its .bin (rebuild both together)")

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} of {len(self)} in {self.prefix}")
        start = int(self.starts[i])
        return self.tokens[start:start + int(self.sizes[i])]

    def max_token(self) -> int:
        """Largest token id in the file (one pass; the launcher checks it against vocab_size)."""
        return int(self.tokens.max()) if self.tokens.size else -1
