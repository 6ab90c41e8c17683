"""Load any checkpoint under any layout, reading only the bytes the caller's pieces need.

    ckpt = Checkpoint.open(root, rank)                # a root (follows `latest`) or a step folder
    arrays = ckpt.read_pieces(param_pieces(plan, rank))

A wanted region saved exactly as such (a same-strategy load) is one run of its shard, found in
the loading rank's own index parts (index_parts.py). Any other is intersected, sub-box by
sub-box (boxes.py), with the saved shards whose box meets it, and the overlaps are read
straight into the destination (transfer.py), so only the touched byte ranges are read, and
only the index entries of the shards read from are parsed. A shard's bytes are read from where
its entry's `start` says (verify, and a load of an index without `start`, read the safetensors
headers). Every checksum block a read touches is verified (once per Checkpoint), so a flipped
bit or a truncated file raises CheckpointError naming the file and the tensor;
`load_with_fallback` then tries the previous checkpoint. Files the memory tier's keeper
verified and sealed (seal.py) are read without a second checksum pass.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, TypeVar

import numpy as np

from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage import commit as commit_mod
from ms_llm.checkpoint.storage.boxes import Region, byte_run, intersect, local_slices
from ms_llm.checkpoint.storage.collector import collector_paused
from ms_llm.checkpoint.storage.format import INDEX, Index, ShardEntry, TensorEntry, decode_state, parse_shard
from ms_llm.checkpoint.storage.index_parts import RawShards, part_name
from ms_llm.checkpoint.storage.safetensors_io import TensorSpan, open_shard_file, read_header, storage_dtype
from ms_llm.checkpoint.storage.seal import Seal
from ms_llm.checkpoint.storage.transfer import BoxMove, Checked, Move, Mover, RunMove, Shard, check_shard
from ms_llm.checkpoint.storage.untrusted import confined, parse_json, read_regular
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.errors import CheckpointError, MsLlmError
from ms_llm.strategy.ir import ParallelStrategy

log = logging.getLogger("ms_llm.checkpoint")
T = TypeVar("T")


class OpenFile(NamedTuple):
    """A shard file a Checkpoint holds open, and whether the memory tier's keeper sealed it."""
    path: Path
    fd: int
    size: int
    sealed: bool


class Checkpoint:
    def __init__(self, folder: str | Path, index: Optional[Index] = None, rank: Optional[int] = None):
        """Open a committed folder; importers pass an `index` they built over foreign
        safetensors files (shards without checksums). `rank`, the loading rank, lets a load under
        the layout it saved parse only that rank's index parts (Index.exact_shard); any load
        reads the same bytes with or without it."""
        self.folder, self.rank = Path(folder), rank
        if index is None:
            path = confined(self.folder, INDEX, "the index")
            try:
                with collector_paused():
                    data = parse_json(read_regular(path), str(path))
            except FileNotFoundError:
                raise CheckpointError(f"{self.folder}: no {INDEX}; not a committed checkpoint") from None
            index = Index.from_json(data, str(path), self.folder)
        self.index: Index = index
        self._files: dict[str, OpenFile] = {}
        self._headers: dict[str, Mapping[str, TensorSpan]] = {}
        self._shards: dict[tuple[str, str], Shard] = {}
        self._checked = Checked()
        self._seal = Seal.load(self.folder)
        self._lock = threading.Lock()
        self.bytes_loaded = 0           # bytes read() and read_pieces() filled: what a load delivered
        # One reading thread more than cores (up to 4): a thread back from its preadv waits to
        # retake the GIL for its checksum loop, and the spare thread keeps its core copying.
        self.workers = min(4, (os.cpu_count() or 1) + 1)

    @classmethod
    def open(cls, path: str | Path, rank: Optional[int] = None) -> "Checkpoint":
        """A step folder, or a checkpoint root whose `latest` pointer names one."""
        path = Path(path)
        if (path / INDEX).is_file():
            return cls(path, rank=rank)
        folder = commit_mod.latest(path)
        if folder is None:
            raise CheckpointError(f"{path}: neither a checkpoint folder ({INDEX}) nor a root with a "
                                  f"'{commit_mod.LATEST}' pointer")
        return cls(folder, rank=rank)

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

    def rank_states(self) -> dict[int, dict[str, Any]]:
        """Every rank's own state, by rank."""
        return {r: decode_state(s) for r, s in self.index.rank_states.items()}

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
        out, moves = self._plan(name, want, out)
        with Mover(self._checked, self.workers) as mover:
            mover.submit(moves)
        self.bytes_loaded += out.nbytes
        return out

    def read_full(self, name: str) -> np.ndarray:
        entry = self.entry(name)
        return self.read(name, Region((0,) * len(entry.shape), entry.shape))

    def read_pieces(self, pieces: dict[str, Piece], strict: bool = True,
                    out: Optional[dict[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
        """Read every piece (into `out[name]` where given); with strict=False tensors the
        checkpoint lacks are left out (e.g. optimizer states when starting from exported weights).
        Every piece is planned before the first read, and the reads go in file order: runs that
        lie back to back in a file are then read together whatever order the pieces came in, and
        planning (Python, holding the GIL) does not hold up the reading threads."""
        missing = [n for n in pieces if n not in self.index.tensors]
        if missing and strict:
            raise CheckpointError(f"{self.folder}: lacks {len(missing)} wanted tensor(s), e.g. {missing[0]!r}; "
                                  "was it saved from a different model?")
        arrays, moves = {}, []
        with collector_paused():
            for name in pieces:
                if name in self.index.tensors:
                    arrays[name], planned = self._plan(name, pieces[name], (out or {}).get(name))
                    moves += planned
            moves.sort(key=lambda m: (m.shard.fd, m.shard.start + m.src))
        with Mover(self._checked, self.workers) as mover:
            mover.submit(moves)
        self.bytes_loaded += sum(a.nbytes for a in arrays.values())
        return arrays

    def verify(self) -> None:
        """Raise CheckpointError listing problems(), one per line, if there are any."""
        found = self.problems()
        if found:
            raise CheckpointError("\n".join(found))

    def problems(self) -> list[str]:
        """What a load of any rank would refuse, one line each, nothing twice (tools and tests;
        a load checks what it reads): every index part (a rank's same-layout load reads its own
        and those its record names in `also`, whether or not the head names it as a tensor's
        saver), every shard a part or a tensor lists (its entry, the file's safetensors header
        saying what the index does, every checksum block) and each tensor's shards covering it.
        The training state is the trainer's to check (ms_llm/run/saved_state.py)."""
        found: dict[str, None] = {}
        checks: list[Callable[[], None]] = []
        if self.index.parts is not None:
            checks += [functools.partial(self._verify_part, rank) for rank in range(len(self.index.parts.records))]
        checks += [functools.partial(self._verify_tensor, name) for name in self.index.tensors]
        for check in checks:
            try:
                check()
            except CheckpointError as exc:
                found.setdefault(" ".join(str(exc).splitlines()), None)
        return list(found)

    def close(self) -> None:
        for file in self._files.values():
            os.close(file.fd)
        self._files.clear()
        self._headers.clear()
        self._shards.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------
    def _verify_part(self, rank: int) -> None:
        """Every shard index part `rank` lists, as a same-layout load of that rank would find it."""
        where = str(self.folder / part_name(rank))
        for name, shards in self.index.parts.part(rank).items():
            entry, raw = self.index.tensors[name], RawShards(shards, [(where, len(shards))])
            for i in range(len(shards)):
                self._verify_shard(entry, parse_shard(raw, i, name, entry.shape, entry.itemsize))

    def _verify_tensor(self, name: str) -> None:
        entry = self.index.tensors[name]
        for shard in entry.shards:                  # going through all of them checks they cover the tensor
            self._verify_shard(entry, shard)

    def _verify_shard(self, entry: TensorEntry, shard: ShardEntry) -> None:
        self._header_span(self._open_file(shard.file, entry.name), entry, shard)
        check_shard(self._shard(entry, shard), self._checked)

    def _plan(self, name: str, want: Region | Piece, out: Optional[np.ndarray]) -> tuple[np.ndarray, list[Move]]:
        """Check the request, allocate (or check) the destination, and list the moves that fill it."""
        entry = self.entry(name)
        dtype = storage_dtype(entry.dtype)
        if isinstance(want, Piece):
            region = want.region
            if tuple(want.shape) != entry.shape:
                raise CheckpointError(f"{self.folder}: tensor {name!r} is {entry.shape} in the checkpoint but "
                                      f"{tuple(want.shape)} in the model loading it; was it saved from a different "
                                      "model config?")
            same = self.index.exact_shard(name, region, self.rank)
            if same is not None:                    # saved as wanted (a same-layout load): one run, inside the tensor
                shard = self._shard(entry, same)
                out = self._destination(name, region, dtype, out)
                return out, [RunMove(shard, 0, out.reshape(-1).view(np.uint8), 0, shard.nbytes)]
        else:
            region = want
        if len(region.offsets) != len(entry.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(region.offsets, region.sizes, entry.shape)):
            raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {entry.shape}; the wanted box "
                                  f"{region.offsets}+{region.sizes} does not fit (a different model config?)")
        size = dtype.itemsize
        # Saved shards whose raw box surely misses the wanted one are not even parsed (maybe_near).
        near = entry.maybe_near(region)
        overlaps = [(wp, k, sp, box) for wp in region.pieces() for k, saved in near for sp in saved.region.pieces()
                    if (box := intersect(wp.offsets, wp.sizes, sp.offsets, sp.sizes)) is not None]
        # The files to read hold what the index says, before anything is allocated.
        used = {o[1] for o in overlaps}
        shards = {k: self._shard(entry, saved) for k, saved in near if k in used}
        out = self._destination(name, region, dtype, out)
        flat = out.reshape(-1)
        dst_bytes = flat.view(np.uint8)
        moves: list[Move] = []
        covered = 0
        for wp, k, sp, box in overlaps:
            covered += math.prod(box[1])
            src, dst = byte_run(box, sp, size), byte_run(box, wp, size)
            if src is not None and dst is not None:
                moves.append(RunMove(shards[k], sp.start * size + src[0], dst_bytes, wp.start * size + dst[0],
                                     src[1] - src[0]))
            else:
                index = local_slices(box, sp)
                dst = flat[wp.start:wp.start + wp.numel].reshape(wp.sizes)[local_slices(box, wp)]
                moves.append(BoxMove(shards[k], sp.start * size, sp.sizes, dtype, index[0].start, index, dst))
        if covered != region.numel:
            raise CheckpointError(f"{self.folder}: tensor {name!r}: the saved shards hold {covered} of the "
                                  f"{region.numel} wanted elements; the index does not cover the tensor")
        return out, moves

    @staticmethod
    def _destination(name: str, region: Region, dtype: np.dtype, out: Optional[np.ndarray]) -> np.ndarray:
        """`out` checked to fit the region, or a new array for it."""
        if out is None:
            return np.empty(region.shape, dtype=dtype)
        if out.shape != region.shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise CheckpointError(f"{name}: destination is {out.dtype} {out.shape}; reading this piece needs a "
                                  f"C-contiguous {dtype} {region.shape} array")
        return out

    def _open_file(self, fname: str, tensor: str) -> OpenFile:
        """A shard file of the folder, opened once."""
        got = self._files.get(fname)
        if got is not None:
            return got
        with self._lock:
            if fname not in self._files:
                path = confined(self.folder, fname, f"the shard 'file' of tensor {tensor!r}")
                fd, st = open_shard_file(str(path))
                self._files[fname] = OpenFile(path, fd, st.st_size, self._seal.matches(fname, st))
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return self._files[fname]

    def _header_span(self, file: OpenFile, entry: TensorEntry, shard: ShardEntry) -> TensorSpan:
        """Where the file's safetensors header puts the shard, checked against the index."""
        spans = self._headers.get(shard.file)
        if spans is None:
            spans = self._headers[shard.file] = read_header(str(file.path))[0]
        span = spans.get(shard.key)
        if span is None:
            raise CheckpointError(f"{file.path}: has no key {shard.key!r} for tensor {entry.name!r}")
        if span.dtype != entry.dtype or span.shape != shard.region.shape:
            raise CheckpointError(f"{file.path}: tensor {entry.name!r} is {span.dtype} {span.shape} in the file but "
                                  f"{entry.dtype} {shard.region.shape} in the index")
        if shard.start is not None and span.start != shard.start:
            raise CheckpointError(f"{file.path}: tensor {entry.name!r} starts at byte {span.start} in the file's "
                                  f"header but at {shard.start} in the index")
        return span

    def _shard(self, entry: TensorEntry, shard: ShardEntry) -> Shard:
        got = self._shards.get((shard.file, shard.key))
        if got is None:
            got = self._shards[shard.file, shard.key] = self._open_shard(entry, shard)
        return got

    def _open_shard(self, entry: TensorEntry, shard: ShardEntry) -> Shard:
        """The shard's bytes in its file: where the index says they start (the header is read
        only for an index that does not say: a foreign file, an older checkpoint)."""
        file = self._open_file(shard.file, entry.name)
        start = shard.start if shard.start is not None else self._header_span(file, entry, shard).start
        nbytes = shard.region.numel * entry.itemsize
        if start + nbytes > file.size:
            raise CheckpointError(f"{file.path}: truncated: tensor {entry.name!r} needs bytes up to {start + nbytes} "
                                  f"but the file has {file.size}")
        return Shard(file.path, file.fd, start, nbytes, shard.block,
                     () if file.sealed else shard.sums, shard.checksum, entry.name, shard.key, file.size)


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


def load_with_fallback(folders: Iterable[Path], load: Callable[[Checkpoint], T],
                       rank: Optional[int] = None) -> tuple[Checkpoint, T]:
    """Run `load` on the first folder that reads cleanly (opened for `rank`, see Checkpoint);
    on CheckpointError try the next.

    In a multi-rank job every rank must end on the same step: the trainer agrees on it
    (e.g. an all-reduce of the steps that loaded) before training on."""
    failures = []
    for folder in folders:
        try:
            ckpt = Checkpoint(folder, rank=rank)
            return ckpt, load(ckpt)
        except CheckpointError as exc:
            log.warning("checkpoint %s unusable, trying the previous one: %s", folder, exc)
            failures.append(f"  - {exc}")
    if not failures:
        raise CheckpointError("no checkpoint to load: no committed checkpoint folder was found")
    raise CheckpointError("every checkpoint failed to load:\n" + "\n".join(failures))
