"""Load any checkpoint under any layout, reading only the bytes the caller's pieces need.

    ckpt = Checkpoint.open(root)                      # a root (follows `latest`) or a step folder
    arrays = ckpt.read_pieces(param_pieces(plan, rank))

For each wanted region the reader intersects its sub-boxes with every saved shard's
sub-boxes (boxes.py) and copies the overlaps out of read-only memory maps of the shard
files, so the operating system reads only the touched pages. Every checksum block the
copy touches is verified first (once per Checkpoint), so a flipped bit or a truncated file
raises CheckpointError naming the file and the tensor. `load_with_fallback` then tries the
previous checkpoint.
"""
from __future__ import annotations

import json
import logging
import math
import mmap
import contextlib
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

import numpy as np

from ms_llm.checkpoint import commit as commit_mod
from ms_llm.checkpoint.boxes import Region, intersect, local_slices, touched_bytes
from ms_llm.checkpoint.format import INDEX, Index, ShardEntry, TensorEntry, decode_state
from ms_llm.checkpoint.safetensors_io import TensorSpan, read_header, storage_dtype
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.untrusted import confined
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.errors import CheckpointError, MsLlmError
from ms_llm.strategy.ir import ParallelStrategy

log = logging.getLogger("ms_llm.checkpoint")
T = TypeVar("T")


class Checkpoint:
    def __init__(self, folder: str | Path, index: Optional[Index] = None):
        """Open a committed folder; importers pass an `index` they built over foreign
        safetensors files (shards without checksums)."""
        self.folder = Path(folder)
        if index is None:
            path = confined(self.folder, INDEX, "the index")
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise CheckpointError(f"{self.folder}: no {INDEX}; not a committed checkpoint") from None
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise CheckpointError(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
            index = Index.from_json(data, str(path))
        self.index: Index = index
        self._files: dict[str, tuple[mmap.mmap, dict[str, TensorSpan]]] = {}
        self._verified: set[tuple[str, str, int]] = set()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.workers = min(8, os.cpu_count() or 1)

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        """A step folder, or a checkpoint root whose `latest` pointer names one."""
        path = Path(path)
        if (path / INDEX).is_file():
            return cls(path)
        folder = commit_mod.latest(path)
        if folder is None:
            raise CheckpointError(f"{path}: neither a checkpoint folder ({INDEX}) nor a root with a "
                                  f"'{commit_mod.LATEST}' pointer")
        return cls(folder)

    # ---- what it holds -----------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.index.step

    @property
    def state(self) -> dict[str, Any]:
        return decode_state(self.index.state)

    @property
    def config(self) -> dict[str, Any]:
        return self.index.config

    def rank_state(self, rank: int) -> Optional[dict[str, Any]]:
        """What rank `rank` saved as its own state (RNG), or None when it had none or the
        checkpoint came from fewer ranks: the caller then derives a fresh one."""
        s = self.index.rank_states.get(rank)
        return decode_state(s) if s is not None else None

    def names(self) -> list[str]:
        return sorted(self.index.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.index.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: has no tensor {name!r}") from None

    def model_config(self) -> ModelConfig:
        if "model" not in self.config:
            raise CheckpointError(f"{self.folder}: index records no model config")
        try:
            return from_dict(ModelConfig, self.config["model"], "model")
        except MsLlmError as exc:
            raise CheckpointError(f"{self.folder}: saved model config: {exc}") from None

    def strategy(self) -> ParallelStrategy:
        if "strategy" not in self.config:
            raise CheckpointError(f"{self.folder}: index records no strategy")
        try:
            return from_dict(ParallelStrategy, self.config["strategy"], "strategy")
        except MsLlmError as exc:
            raise CheckpointError(f"{self.folder}: saved strategy: {exc}") from None

    # ---- reading -----------------------------------------------------------------------
    def read(self, name: str, want: Region | Piece, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The data of region `want` of tensor `name`: shaped like the box, or 1-d for a flat
        region; bfloat16 comes back as its raw uint16 bits. `out` (C-contiguous, that shape and
        the storage dtype) receives it in place, e.g. a view of the parameter being loaded."""
        entry = self.entry(name)
        region = want.region if isinstance(want, Piece) else want
        if len(region.offsets) != len(entry.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(region.offsets, region.sizes, entry.shape)):
            raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {entry.shape}; the wanted box "
                                  f"{region.offsets}+{region.sizes} does not fit (a different model config?)")
        dtype = storage_dtype(entry.dtype)
        for shard in entry.shards:      # every shard's file holds what the index says, before allocating
            self._span(entry, shard)
        if out is None:
            out = np.empty(region.shape, dtype=dtype)
        elif out.shape != region.shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise CheckpointError(f"{name}: destination is {out.dtype} {out.shape}; reading this piece needs a "
                                  f"C-contiguous {dtype} {region.shape} array")
        flat = out.reshape(-1)
        covered = 0
        for wp in region.pieces():
            dst_piece = flat[wp.start:wp.start + wp.numel].reshape(wp.sizes)
            for shard in entry.shards:
                for sp in shard.region.pieces():
                    box = intersect(wp.offsets, wp.sizes, sp.offsets, sp.sizes)
                    if box is None:
                        continue
                    covered += math.prod(box[1])
                    src_runs = touched_bytes(box, sp, dtype.itemsize)
                    dst_runs = touched_bytes(box, wp, dtype.itemsize)
                    if len(src_runs[0]) == 1 and len(dst_runs[0]) == 1:    # one byte run each side
                        lo = wp.start * dtype.itemsize + int(dst_runs[0][0])
                        dst = memoryview(flat.view(np.uint8))[lo:lo + int(dst_runs[1][0] - dst_runs[0][0])]
                        self._pread(entry, shard, sp.start * dtype.itemsize + int(src_runs[0][0]), dst)
                        continue
                    src = self._shard_view(entry, shard, sp.start, sp.numel).reshape(sp.sizes)
                    self._verify(entry, shard, sp.start * dtype.itemsize, box, sp)
                    dst_piece[local_slices(box, wp)] = src[local_slices(box, sp)]
        if covered != region.numel:
            raise CheckpointError(f"{self.folder}: tensor {name!r}: the saved shards hold {covered} of the "
                                  f"{region.numel} wanted elements; the index does not cover the tensor")
        return out

    def read_full(self, name: str) -> np.ndarray:
        entry = self.entry(name)
        return self.read(name, Region((0,) * len(entry.shape), entry.shape))

    def read_pieces(self, pieces: dict[str, Piece], strict: bool = True,
                    out: Optional[dict[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
        """Read every piece (into `out[name]` where given); with strict=False tensors the
        checkpoint lacks are left out (e.g. optimizer states when starting from exported weights)."""
        missing = [n for n in pieces if n not in self.index.tensors]
        if missing and strict:
            raise CheckpointError(f"{self.folder}: lacks {len(missing)} wanted tensor(s), e.g. {missing[0]!r}; "
                                  "was it saved from a different model?")
        names = [n for n in pieces if n in self.index.tensors]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:    # copies and CRCs release the GIL
            return dict(zip(names, pool.map(lambda n: self.read(n, pieces[n], (out or {}).get(n)), names)))

    def verify(self) -> None:
        """Check every block of every shard (tools and tests; loading checks what it reads)."""
        for entry in self.index.tensors.values():
            for shard in entry.shards:
                for sp in shard.region.pieces():
                    self._verify(entry, shard, sp.start * storage_dtype(entry.dtype).itemsize,
                                 (sp.offsets, sp.sizes), sp)

    def close(self) -> None:
        for mm, _ in self._files.values():
            with contextlib.suppress(BufferError):    # a view is still alive (e.g. in an error's traceback):
                mm.close()                            # the map is freed with it
        for fd in self._fds.values():
            os.close(fd)
        self._files.clear()
        self._fds.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------
    def _open_file(self, fname: str, tensor: str) -> tuple[mmap.mmap, dict[str, TensorSpan]]:
        with self._lock:
            return self._open_file_locked(fname, tensor)

    def _open_file_locked(self, fname: str, tensor: str) -> tuple[mmap.mmap, dict[str, TensorSpan]]:
        if fname not in self._files:
            path = confined(self.folder, fname, f"the shard 'file' of tensor {tensor!r}")
            spans, _, size = read_header(str(path))
            fd = os.open(path, os.O_RDONLY)
            self._fds[fname] = fd
            self._files[fname] = (mmap.mmap(fd, size, access=mmap.ACCESS_READ), spans)
        return self._files[fname]

    def _pread(self, entry: TensorEntry, shard: ShardEntry, start: int, dst: memoryview) -> None:
        """Read shard bytes [start, start + len(dst)) straight into `dst` (the fast path for
        contiguous pieces: one kernel copy), then check the checksum blocks they touch: whole
        blocks on `dst` itself, the two partial edge blocks on the file."""
        mm, span = self._span(entry, shard)
        fd, n, done = self._fds[shard.file], len(dst), 0
        while done < n:
            got = os.preadv(fd, [dst[done:]], span.start + start + done)
            if got <= 0:
                raise CheckpointError(f"{self.folder / shard.file}: tensor {entry.name!r}: file ended while reading")
            done += got
        if not shard.crc32:
            return
        block = shard.block
        for b in range(start // block, (start + n - 1) // block + 1):
            key = (shard.file, shard.key, b)
            lo, hi = b * block, min((b + 1) * block, span.nbytes)
            if key in self._verified:
                continue
            data = dst[lo - start:hi - start] if start <= lo and hi <= start + n else \
                memoryview(mm)[span.start + lo:span.start + hi]
            self._check_block(entry, shard, b, data, span.start + lo)

    def _span(self, entry: TensorEntry, shard: ShardEntry) -> tuple[mmap.mmap, TensorSpan]:
        mm, spans = self._open_file(shard.file, entry.name)
        span = spans.get(shard.key)
        if span is None:
            raise CheckpointError(f"{self.folder / shard.file}: has no key {shard.key!r} for tensor {entry.name!r}")
        if span.dtype != entry.dtype or span.shape != shard.region.shape:
            raise CheckpointError(f"{self.folder / shard.file}: tensor {entry.name!r} is {span.dtype} "
                                  f"{span.shape} in the file but {entry.dtype} {shard.region.shape} in the index")
        return mm, span

    def _shard_view(self, entry: TensorEntry, shard: ShardEntry, start: int, count: int) -> np.ndarray:
        mm, span = self._span(entry, shard)
        dtype = storage_dtype(entry.dtype)
        return np.frombuffer(mm, dtype=dtype, count=count, offset=span.start + start * dtype.itemsize)

    def _verify(self, entry: TensorEntry, shard: ShardEntry, base: int, box, sub) -> None:
        """Check the CRC32 of every block of the shard that reading `box` of sub-box `sub`
        (which starts `base` bytes into the shard) touches."""
        if not shard.crc32:
            return                              # a foreign file (import): nothing to check against
        mm, span = self._span(entry, shard)
        block = shard.block
        nblocks = len(shard.crc32)
        if nblocks != -(-span.nbytes // block):
            raise CheckpointError(f"{self.folder / shard.file}: tensor {entry.name!r} has {nblocks} checksums "
                                  f"for {span.nbytes} bytes in blocks of {block}")
        starts, ends = touched_bytes(box, sub, storage_dtype(entry.dtype).itemsize)
        marks = np.zeros(nblocks + 1, dtype=np.int64)
        np.add.at(marks, (base + starts) // block, 1)
        np.add.at(marks, (base + ends - 1) // block + 1, -1)
        for b in np.flatnonzero(np.cumsum(marks[:-1]) > 0):
            key = (shard.file, shard.key, int(b))
            if key in self._verified:
                continue
            lo = span.start + int(b) * block
            hi = min(lo + block, span.start + span.nbytes)
            self._check_block(entry, shard, int(b), memoryview(mm)[lo:hi], lo)

    def _check_block(self, entry: TensorEntry, shard: ShardEntry, b: int, data: memoryview, at: int) -> None:
        if zlib.crc32(data) != shard.crc32[b]:
            raise CheckpointError(f"{self.folder / shard.file}: tensor {entry.name!r} (key {shard.key!r}) fails "
                                  f"its checksum in bytes [{at}, {at + len(data)}): the file is corrupted")
        self._verified.add((shard.file, shard.key, b))


def candidates(*roots: str | Path) -> list[Path]:
    """Committed checkpoint folders under the roots, newest step first; at equal steps the
    earlier root first (pass the memory tier before the disk root)."""
    found: list[tuple[int, int, Path]] = []
    for order, root in enumerate(roots):
        if root is None or not Path(root).is_dir():
            continue
        commit_mod.latest(Path(root))       # warns when it names a missing folder, refuses one outside root
        for folder in commit_mod.committed(Path(root)):
            found.append((-int(folder.name[5:]), order, folder))
    return [f for _, _, f in sorted(found)]


def load_with_fallback(folders: Iterable[Path], load: Callable[[Checkpoint], T]) -> tuple[Checkpoint, T]:
    """Run `load` on the first folder that reads cleanly; on CheckpointError try the next.

    In a multi-rank job every rank must end on the same step: the trainer agrees on it
    (e.g. an all-reduce of the steps that loaded) before training on."""
    failures = []
    for folder in folders:
        try:
            ckpt = Checkpoint(folder)
            return ckpt, load(ckpt)
        except CheckpointError as exc:
            log.warning("checkpoint %s unusable, trying the previous one: %s", folder, exc)
            failures.append(f"  - {exc}")
    if not failures:
        raise CheckpointError("no checkpoint to load: no committed checkpoint folder was found")
    raise CheckpointError("every checkpoint failed to load:\n" + "\n".join(failures))
