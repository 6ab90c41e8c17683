"""Two-stage save: snapshot to host memory on the training thread, persist in the background.

    writer = CheckpointWriter(root, rank, world_size, session=run_id)
    stats = writer.save(step, items, state=..., config=run_config(plan, "torch"), overlap=True)
    ...the next step's forward and backward...
    writer.fence()                                    # before the optimizer changes any tensor
    ...training continues...
    writer.wait()                                     # only needed before exit

Stage 1 (the snapshot): wait for this rank's previous save, then copy every primary piece into
one reusable host buffer laid out as the final safetensors file image. Without `overlap`,
save() returns after the copy; with it, save() returns once the copies are queued and they
run beside the next forward and backward, which only read the tensors (CheckFreq's pipelined
snapshot): training stalls only where fence() still finds copies running.
Stage 2 (a background thread, after the copies): a checksum per block (checksum.py), then the
image goes to the memory tier (/dev/shm, if enabled) and to <root>/step_N.tmp/ with fsync,
then this rank's fragment;
rank 0 commits (commit.py) once every rank's fragment is there. Errors from stage 2 are
raised by the next save() or wait(), so a failed save is never silent.
"""
from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np

from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage import commit as commit_mod
from ms_llm.checkpoint.storage.checksum import DEFAULT as CHECKSUM, block_checksums
from ms_llm.checkpoint.storage.direct_io import aligned_buffer, write_file
from ms_llm.checkpoint.storage.format import ShardEntry, encode_state, rank_file
from ms_llm.checkpoint.storage.index_parts import encode_part
from ms_llm.checkpoint.storage.safetensors_io import TensorSpan, dtype_name, header_bytes, storage_dtype
from ms_llm.checkpoint.storage.untrusted import confined
from ms_llm.errors import CheckpointError

# A local tensor as numpy (a view is fine: it is copied before save() returns) or a function
# that fills a given numpy array (lets a backend copy device memory straight into the buffer).
Data = Union[np.ndarray, Callable[[np.ndarray], None]]
COPY_CHUNK = 8 << 20               # bytes per snapshot copy job


@dataclass(frozen=True)
class SaveItem:
    """A piece this rank holds and its data. A piece another replica saves (not primary) needs
    no data: the writer records that this rank holds it, so the index names where it was saved
    and this rank's resume reads only those parts."""
    piece: Piece
    data: Optional[Data]
    dtype: str = ""                 # our dtype name; required for callables and for bfloat16


T = TypeVar("T")


def held_items(pieces: Mapping[str, Piece], tensors: Mapping[str, T],
               convert: Callable[[Piece, T], SaveItem]) -> list[SaveItem]:
    """SaveItems for every piece a rank holds: a backend's `convert` makes the item of each piece
    this rank saves (primary) from its local tensor; a piece another replica saves goes without
    data, nothing converted (the writer records that this rank holds it)."""
    items = []
    for name, piece in pieces.items():
        if name not in tensors:
            raise CheckpointError(f"{name}: the plan puts a piece of it on this rank but no local tensor was given")
        items.append(convert(piece, tensors[name]) if piece.primary else SaveItem(piece, None))
    return items


@dataclass
class SaveStats:
    step: int
    bytes: int = 0                  # bytes this rank wrote
    wait_s: float = 0.0             # part of the stall spent waiting for the previous save
    stall_s: float = 0.0            # time save() and fence() blocked training (wait + snapshot)
    persist_s: float = 0.0          # background: checksums + memory tier + disk + fsync
    total_s: float = 0.0            # from save() to durable (to commit on rank 0)
    memory_s: float = 0.0           # background time until the memory-tier copy was published
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    copied: threading.Event = field(default_factory=threading.Event, repr=False)   # the snapshot is taken
    fenced_at: Optional[float] = field(default=None, repr=False)   # when fence() began waiting
    copied_at: float = field(default=0.0, repr=False)
    saved_s: float = field(default=0.0, repr=False)                # time inside save()

    def settle_stall(self) -> None:
        """The stall once the copies are done: save()'s own time plus what fence() waited for
        them. Both threads compute it with this one formula (a fence that begins after the
        copies waited for nothing), so the metrics and the checkpoint's record agree."""
        waited = 0.0 if self.fenced_at is None else max(0.0, self.copied_at - self.fenced_at)
        self.stall_s = self.saved_s + waited

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("step", "bytes", "wait_s", "stall_s", "persist_s", "total_s",
                                              "memory_s")}


@dataclass
class _Layout:
    items: list[SaveItem]
    dtypes: list[str]
    keys: list[str]
    spans: list[TensorSpan]
    header: bytes
    nbytes: int


class CheckpointWriter:
    def __init__(self, root: str | Path, rank: int, world_size: int, *, session: str = "",
                 keep_last: int = 3, memory=None, block_bytes: int = 4 << 20,
                 max_bytes_per_s: float = 0.0, commit_timeout_s: float = 1800.0, workers: int = 0):
        """`session` must be equal on all ranks of one launch and new for every relaunch (e.g.
        the launcher's run id plus restart count): it keeps fragments of a crashed attempt out
        of a later commit. `memory` is a memory_tier.MemoryTier or None. `max_bytes_per_s`
        throttles the background disk write (0 = unthrottled) so it leaves bandwidth to the
        job's data loading. `workers` threads copy and checksum (0 = up to 8, one per core)."""
        if not 0 <= rank < world_size:
            raise CheckpointError(f"checkpoint writer: rank {rank} outside world size {world_size}")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.session, self.keep_last = session, keep_last
        self.memory = memory
        self.block_bytes, self.max_bytes_per_s = block_bytes, max_bytes_per_s
        self.commit_timeout_s = commit_timeout_s
        self._buffer = aligned_buffer(0)
        self._pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1),
                                        thread_name_prefix="ckpt-copy")
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last: Optional[SaveStats] = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{self.root}: cannot create the checkpoint folder ({exc.strerror or exc})") from None
        if memory is not None:
            memory.attach(rank, world_size)

    # ---- stage 1: on the training thread -------------------------------------------------
    def save(self, step: int, items: Sequence[SaveItem], *, state: Optional[dict] = None,
             rank_state: Optional[dict] = None, config: Optional[dict] = None,
             overlap: bool = False) -> SaveStats:
        """Snapshot `items` (every piece this rank holds; only the primary ones are written) and
        return; persisting goes on in the background. With `overlap` the snapshot's copies go
        on too, and fence() must come before anything writes to the items' tensors. `state` is
        the shared training state (same on every rank; rank 0's is kept), `rank_state` this
        rank's own (RNG states; bytes allowed)."""
        start = time.perf_counter()
        self._join()
        stats = SaveStats(step=step, wait_s=time.perf_counter() - start)
        if self.memory is not None and self.rank == 0:
            self.memory.heartbeat()
        missing = next((i.piece for i in items if i.piece.primary and i.data is None), None)
        if missing is not None:
            raise CheckpointError(f"{missing.name}: this rank saves the piece at offsets {missing.region.offsets} "
                                  "(it is primary) but its SaveItem has no data")
        layout = self._layout([i for i in items if i.piece.primary])
        if self._buffer.nbytes < layout.nbytes:
            self._buffer = aligned_buffer(layout.nbytes)
        image = self._buffer[:layout.nbytes]
        image[:len(layout.header)] = np.frombuffer(layout.header, dtype=np.uint8)
        dsts = [image[span.start:span.start + span.nbytes].view(storage_dtype(dtype)).reshape(span.shape)
                for dtype, span in zip(layout.dtypes, layout.spans)]
        copies = [c for item, dst in zip(layout.items, dsts) for c in self._copies(item, dst)]
        meta = {"state": encode_state(state or {}), "rank_state": encode_state(rank_state or {}),
                "config": config or {},         # and the pieces held here that another replica saves
                "held": [{"name": i.piece.name, **i.piece.region.to_json()} for i in items if not i.piece.primary]}
        stats.bytes = layout.nbytes
        self.last = stats
        self._thread = threading.Thread(target=self._persist_guarded,
                                        args=(stats, layout, image, copies, meta, start),
                                        name=f"ckpt-persist-{step}", daemon=True)
        stats.saved_s = time.perf_counter() - start
        self._thread.start()
        if not overlap:
            self.fence()
        return stats

    def fence(self) -> None:
        """Block until the last save's snapshot is taken: from then on its tensors may change."""
        stats = self.last
        if stats is None:
            return
        if stats.fenced_at is None:
            stats.fenced_at = time.perf_counter()
        stats.copied.wait()
        stats.settle_stall()

    def wait(self) -> Optional[SaveStats]:
        """Block until the last save is durable (committed, on rank 0); re-raise its error."""
        self.fence()
        self._join()
        return self.last

    def close(self) -> None:
        """Wait for the last save; the memory tier's snapshot stays for a restart."""
        self.wait()
        self._pool.shutdown()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{self.root}: background save failed: {type(error).__name__}: {error}") from error

    def _layout(self, items: list[SaveItem]) -> _Layout:
        dtypes = []
        for item in items:
            if item.dtype:
                storage_dtype(item.dtype)
                dtypes.append(item.dtype)
            elif isinstance(item.data, np.ndarray):
                dtypes.append(dtype_name(item.data))
            else:
                raise CheckpointError(f"{item.piece.name}: a copy function needs an explicit dtype")
        order = sorted(range(len(items)), key=lambda i: -storage_dtype(dtypes[i]).itemsize)
        items, dtypes = [items[i] for i in order], [dtypes[i] for i in order]
        keys, seen = [], {}
        for item in items:
            n = seen.get(item.piece.name, 0)
            seen[item.piece.name] = n + 1
            keys.append(item.piece.name if n == 0 else f"{item.piece.name}#{n}")
        header, spans = header_bytes([(k, d, i.piece.region.shape) for k, d, i in zip(keys, dtypes, items)],
                                     {"format": "pt", "writer": "ms_llm"})
        nbytes = spans[-1].start + spans[-1].nbytes if spans else len(header)
        return _Layout(items, dtypes, keys, spans, header, nbytes)

    @staticmethod
    def _copies(item: SaveItem, dst: np.ndarray) -> list[Callable[[], None]]:
        """The copies that snapshot one item: contiguous numpy arrays in slices of COPY_CHUNK
        bytes, so the pool's threads share a few large tensors evenly."""
        if callable(item.data) and not isinstance(item.data, np.ndarray):
            return [lambda: item.data(dst)]
        src = item.data
        if tuple(src.shape) != dst.shape:
            raise CheckpointError(f"{item.piece.name}: local tensor has shape {tuple(src.shape)} but its piece at "
                                  f"offsets {item.piece.region.offsets} needs {dst.shape}")
        if src.dtype != dst.dtype:
            raise CheckpointError(f"{item.piece.name}: local tensor is {src.dtype}, declared dtype stores "
                                  f"{dst.dtype}; convert it first")
        if not src.flags.c_contiguous or src.nbytes <= COPY_CHUNK:
            return [lambda: np.copyto(dst, src)]
        s, d, step = src.reshape(-1), dst.reshape(-1), COPY_CHUNK // src.itemsize
        return [lambda a=a: np.copyto(d[a:a + step], s[a:a + step]) for a in range(0, s.size, step)]

    # ---- stage 2: background --------------------------------------------------------------
    def _persist_guarded(self, stats: SaveStats, layout: _Layout, image: np.ndarray,
                         copies: list[Callable[[], None]], meta: dict, start: float) -> None:
        try:
            try:
                list(self._pool.map(lambda copy: copy(), copies))     # copies release the GIL: in parallel
            finally:
                stats.copied_at = time.perf_counter()
                stats.copied.set()
            stats.settle_stall()
            self._persist(stats, layout, image, meta, start)
        except OSError as exc:                 # ENOSPC, EIO, EROFS: say where and how much
            self._error = self._write_error(stats, exc)
        except BaseException as exc:           # handed to the training thread by _join
            self._error = exc
        finally:
            stats.done.set()

    def _write_error(self, stats: SaveStats, exc: OSError) -> CheckpointError:
        """One line naming the folder, the bytes this rank needed and what `latest` still names;
        the OSError stays the cause (its errno tells a full disk from a failing one)."""
        try:
            free = f"{shutil.disk_usage(self.root).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        error = CheckpointError(f"{commit_mod.tmp_dir(self.root, stats.step)}: cannot write checkpoint step "
                                f"{stats.step} ({exc.strerror or exc}); rank {self.rank} needs {stats.bytes:,} bytes "
                                f"there, {free}; the previous checkpoint is intact and still named by "
                                f"{self.root / commit_mod.LATEST}")
        error.__cause__ = exc
        return error

    def _persist(self, stats: SaveStats, layout: _Layout, image: np.ndarray, meta: dict, start: float) -> None:
        t0 = time.perf_counter()
        # Checksums on the pool while this thread writes the file; the fragment needs both.
        crcs = [self._pool.submit(self._checksums, image, span) for span in layout.spans]
        elements: dict[str, int] = {}                       # what the commit checks each tensor's coverage with
        cuts: dict[str, Optional[list[tuple[int, int, int]]]] = {}  # and finds evenly split tensors with
        for item in layout.items:
            name, region = item.piece.name, item.piece.region
            elements[name] = elements.get(name, 0) + region.numel
            cuts[name] = None if name in cuts else region.cuts(tuple(item.piece.shape))
        fragment = {"rank": self.rank, "session": self.session, "file": rank_file(self.rank), **meta,
                    "tensors": {i.piece.name: {"shape": list(i.piece.shape), "dtype": d, "layout": i.piece.layout}
                                for i, d in zip(layout.items, layout.dtypes)}, "elements": elements,
                    "cuts": {name: [list(c) for c in cut] for name, cut in cuts.items() if cut is not None}}

        @functools.cache
        def part() -> bytes:
            """This rank's index part: its shards as the index lists them, by tensor name (the
            same bytes for the memory tier and the disk)."""
            shards: dict[str, list[dict]] = {}
            for item, key, span, crc in zip(layout.items, layout.keys, layout.spans, crcs):
                shard = ShardEntry(fragment["file"], key, item.piece.region, self.block_bytes, tuple(crc.result()),
                                   CHECKSUM, span.start)
                shards.setdefault(item.piece.name, []).append(shard.to_json())
            return encode_part(self.rank, step, shards)
        step = stats.step
        merged = len(layout.items) * self.world_size      # about what the ranks saved: this rank's shards x ranks
        if self.memory is not None:
            self._write_data(self.memory.root, step, image, throttle=False)
            commit_mod.write_fragment(commit_mod.tmp_dir(self.memory.root, step), self.rank, fragment, part())
            if self.rank == 0:
                commit_mod.commit_beside(self.memory.root, step, self.world_size, self.session, self.commit_timeout_s,
                                         merged)
                commit_mod.retain(self.memory.root, self.memory.keep_last)
            stats.memory_s = time.perf_counter() - t0
        self._write_data(self.root, step, image, throttle=True)
        fragment["stats"] = {"stall_s": stats.stall_s, "persist_s": time.perf_counter() - t0}
        commit_mod.write_fragment(commit_mod.tmp_dir(self.root, step), self.rank, fragment, part())
        if self.rank == 0:
            commit_mod.commit_beside(self.root, step, self.world_size, self.session, self.commit_timeout_s, merged)
        stats.persist_s = time.perf_counter() - t0
        stats.total_s = time.perf_counter() - start            # durable; deleting old ones is not on that path
        if self.rank == 0:
            commit_mod.retain(self.root, self.keep_last)

    def _checksums(self, image: np.ndarray, span) -> list[int]:
        return block_checksums(memoryview(image[span.start:span.start + span.nbytes]), self.block_bytes)

    def _write_data(self, root: Path, step: int, image: np.ndarray, throttle: bool) -> None:
        """This rank's shard file into the step's temporary folder, fsynced."""
        folder = commit_mod.tmp_dir(root, step)
        folder.mkdir(parents=True, exist_ok=True)
        write_file(confined(root, f"{folder.name}/{rank_file(self.rank)}", "a shard file"), self._buffer, len(image),
                   self.max_bytes_per_s if throttle else 0.0)
