"""Moving checkpoint bytes from shard files into destination arrays, checksums checked on the way.

The reader (reader.py) turns every overlap of a wanted sub-box with a saved one into a Move;
this module runs them. When the overlap is one byte run both in the file and in the
destination (every same-layout load, and splits along the first dimension), `RunMove` reads it
straight into the destination's memory: one kernel copy. Otherwise `BoxMove` reads whole rows
of the saved sub-box into a scratch buffer and copies the box out with one numpy copy (cheaper
than a Python loop over thousands of small rows). Moves' chunks that are whole checksum blocks
and lie back to back in one file (a same-layout load reads a rank's file front to back, one
small tensor after another; a reshard that merges split rows reads whole saved shards) are
gathered into a `Batch`: one preadv into all their destinations and scratch rows, then each
block is checked while the batch is still in the CPU cache and the boxes are copied out.
Other chunks go through `read_checked`, which reads in SUB-byte pieces, each checksummed as
soon as it lands, while it is still in the CPU cache (checking bytes already evicted to
memory would cost as much as reading them again). The chunks and batches run on a small
thread pool (Mover): preadv, the checksums (checksum.py) and numpy copies release the GIL, so
the cores read and check in parallel. A chunk or batch not in the page cache asks the kernel
for its bytes first (prefetch), unless the load reads its file on to the end without a gap: the
kernel's sequential readahead serves such a file faster.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence, Union

import numpy as np

from ms_llm.checkpoint.storage.checksum import ALGORITHMS
from ms_llm.errors import CheckpointError

CHUNK = 4 << 20                     # bytes per unit of work (rounded to whole checksum blocks)
SUB = 256 << 10                     # bytes read then checksummed at a time: fits in a core's L2 cache
IOV = 512                           # destinations per batched preadv (the kernel takes up to IOV_MAX = 1024)


class Shard(NamedTuple):
    """One saved shard's bytes in an open file, and the checksums to hold them to (a NamedTuple:
    a load builds one per shard it reads)."""
    path: Path                      # for messages
    fd: int
    start: int                      # absolute file offset of the shard's first byte
    nbytes: int
    block: int                      # bytes per checksum block
    sums: tuple[int, ...]           # empty: nothing to check (a foreign or keeper-verified file)
    checksum: str                   # their algorithm (checksum.ALGORITHMS)
    tensor: str                     # for messages
    key: str
    file_size: int                  # of the whole file (a load that reads on to its end streams it)

    def blocks(self, lo: int, hi: int) -> range:
        """Checksum blocks that bytes [lo, hi) of the shard touch (none without checksums)."""
        if not self.sums or hi <= lo:
            return range(0)
        return range(lo // self.block, (hi - 1) // self.block + 1)

    def block_range(self, b: int) -> tuple[int, int]:
        return b * self.block, min((b + 1) * self.block, self.nbytes)

    def whole_blocks(self, lo: int, hi: int) -> bool:
        """Whether bytes [lo, hi) are whole checksum blocks (or unchecked): a Batch can read and
        check them."""
        return not self.sums or lo % self.block == 0 and (hi % self.block == 0 or hi == self.nbytes)

    def step(self) -> int:
        """Chunk length: whole blocks, about CHUNK bytes."""
        return self.block * max(1, CHUNK // self.block) if self.sums else CHUNK


class Checked:
    """Blocks already verified in this Checkpoint (a block shared by two reads is checked once)."""

    def __init__(self) -> None:
        self._done: set[tuple[str, int]] = set()

    def __contains__(self, item: tuple[Shard, int]) -> bool:
        shard, b = item
        return (f"{shard.path}\0{shard.key}", b) in self._done

    def check(self, shard: Shard, b: int, value: int) -> None:
        """Compare block `b`'s checksum `value` with the index."""
        if value != shard.sums[b]:
            lo, hi = shard.block_range(b)
            raise CheckpointError(f"{shard.path}: tensor {shard.tensor!r} (key {shard.key!r}) fails its checksum "
                                  f"in bytes [{shard.start + lo}, {shard.start + hi}): the file is corrupted")
        self._done.add((f"{shard.path}\0{shard.key}", b))


def read_into(shard: Shard, view: memoryview, offset: int) -> None:
    """Fill `view` from the shard's bytes starting at `offset` (relative to the shard)."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(shard.fd, [view[done:]], shard.start + offset + done)
        except OSError as exc:              # EIO on a failing disk: the caller falls back to an older one
            raise CheckpointError(f"{shard.path}: tensor {shard.tensor!r}: cannot read ({exc.strerror or exc})") from None
        if got <= 0:
            raise CheckpointError(f"{shard.path}: tensor {shard.tensor!r}: file ended while reading")
        done += got


def readv_into(path: Path, fd: int, views: list[memoryview], offset: int, tensor: str) -> None:
    """Fill `views` in order from the file's bytes starting at absolute `offset`."""
    views = [v for v in views if len(v)]
    while views:
        try:
            got = os.preadv(fd, views[:IOV], offset)
        except OSError as exc:
            raise CheckpointError(f"{path}: tensor {tensor!r}: cannot read ({exc.strerror or exc})") from None
        if got <= 0:
            raise CheckpointError(f"{path}: tensor {tensor!r}: file ended while reading")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]


def pread(shard: Shard, lo: int, hi: int) -> memoryview:
    """Shard bytes [lo, hi) in a new buffer (not zero-filled first)."""
    out = memoryview(np.empty(hi - lo, np.uint8))
    read_into(shard, out, lo)
    return out


def prefetch(fd: int, offset: int, n: int) -> None:
    """Have the kernel start reading file bytes [offset, offset + n) at once (WILLNEED) unless
    the page cache holds them, as told by a non-blocking read of their last byte: threads
    reading one file at different offsets defeat its sequential readahead, so a cold chunk
    would otherwise arrive one small synchronous read per piece, and a warm one needs no hint.
    Callers skip it for a file the load reads on to its end without a gap (`streamed`): there
    the kernel's readahead streams the file faster than hints chunk by chunk, and it reads
    nothing the load does not want; stopping short or skipping, it would read on past."""
    if n > 0 and not _cached(fd, offset + n - 1):
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)


def _cached(fd: int, offset: int) -> bool:
    """Whether the page cache holds the file's byte at `offset`, by a read that may not block."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except OSError:                     # EAGAIN: not cached; EOPNOTSUPP: the file system cannot say
        return False


def read_checked(shard: Shard, view: memoryview, offset: int, checked: Checked, hint: bool) -> None:
    """Fill `view` with the shard's bytes from `offset`, verifying every checksum block they
    touch that `checked` has not seen (an edge block's bytes outside `view` are read from the
    file for it). Each SUB-byte piece is checksummed right after it is read. `hint`: prefetch
    the bytes (False for a file the load streams)."""
    end = offset + len(view)
    if hint:
        prefetch(shard.fd, shard.start + offset, len(view))
    pos = offset                                    # view bytes before it are filled
    for blk in shard.blocks(offset, end):
        if (shard, blk) in checked:
            continue
        lo, hi = shard.block_range(blk)
        first, last = max(lo, offset), min(hi, end)
        if pos < first:                             # blocks verified before
            read_into(shard, view[pos - offset:first - offset], pos)
        update = ALGORITHMS[shard.checksum]
        value = update(pread(shard, lo, first), 0) if lo < first else 0
        for a in range(first, last, SUB):
            part = view[a - offset:min(a + SUB, last) - offset]
            read_into(shard, part, a)
            value = update(part, value)
        if last < hi:
            value = update(pread(shard, last, hi), value)
        checked.check(shard, blk, value)
        pos = last
    if pos < end:
        read_into(shard, view[pos - offset:], pos)


@dataclass
class RunMove:
    """Shard bytes [src, src + nbytes) straight into dst[at:at + nbytes] (dst: flat uint8)."""
    shard: Shard
    src: int
    dst: np.ndarray
    at: int
    nbytes: int

    def chunks(self) -> list[tuple[int, int]]:
        """[a, b) byte ranges of the move, cut at the shard's chunk boundaries."""
        step, end = self.shard.step(), self.nbytes
        edges = [0, *range((self.src // step + 1) * step - self.src, end, step), end]
        return list(zip(edges[:-1], edges[1:]))

    def span(self, a: int, b: int) -> tuple[int, int]:
        """The shard's bytes that chunk [a, b) reads."""
        return self.src + a, self.src + b

    def view(self, a: int, b: int) -> memoryview:
        """Where chunk [a, b)'s bytes are read to: the destination itself."""
        return memoryview(self.dst)[self.at + a:self.at + b]

    def finish(self, a: int, b: int, landed: memoryview) -> None:
        """Nothing: the bytes landed in place."""

    def run(self, a: int, b: int, checked: Checked, hint: bool) -> None:
        read_checked(self.shard, self.view(a, b), self.src + a, checked, hint)

    def extent(self) -> tuple[int, int]:
        """The file bytes [lo, hi) the move reads."""
        lo, hi = self.span(0, self.nbytes)
        return self.shard.start + lo, self.shard.start + hi


@dataclass
class BoxMove:
    """A box of a saved sub-box (C-order `sizes`, starting `src` bytes into the shard) into `dst`
    (the destination view of that box): rows [r0, r1) of the sub-box's first dimension are read
    whole into scratch, checked there, and `index` (the box within those rows) is copied out."""
    shard: Shard
    src: int
    sizes: tuple[int, ...]
    dtype: np.dtype
    r0: int
    index: tuple[slice, ...]         # into rows [r0, r1), first entry covering them all
    dst: np.ndarray

    @property
    def row(self) -> int:
        return math.prod(self.sizes[1:]) * self.dtype.itemsize

    def chunks(self) -> list[tuple[int, int]]:
        per = max(1, self.shard.step() // max(1, self.row))
        rows = self.dst.shape[0]
        return [(a, min(a + per, rows)) for a in range(0, rows, per)]

    def span(self, a: int, b: int) -> tuple[int, int]:
        """The shard's bytes that rows [a, b) of the box read: those rows of the sub-box, whole."""
        return self.src + (self.r0 + a) * self.row, self.src + (self.r0 + b) * self.row

    def finish(self, a: int, b: int, landed: memoryview) -> None:
        """Copy the box out of rows [a, b), read whole into `landed`."""
        rows = np.frombuffer(landed, self.dtype).reshape((b - a,) + self.sizes[1:])
        np.copyto(self.dst[a:b], rows[(slice(None),) + self.index[1:]])

    def run(self, a: int, b: int, checked: Checked, hint: bool) -> None:
        lo, hi = self.span(a, b)
        landed = scratch(hi - lo)
        read_checked(self.shard, landed, lo, checked, hint)
        self.finish(a, b, landed)

    def extent(self) -> tuple[int, int]:
        """The file bytes [lo, hi) the move reads."""
        lo, hi = self.span(0, self.dst.shape[0])
        return self.shard.start + lo, self.shard.start + hi


Move = Union[RunMove, BoxMove]

_SCRATCH = threading.local()


def scratch(nbytes: int) -> memoryview:
    """A scratch buffer of `nbytes`: up to two chunks, this thread's own, kept from load to
    load (fresh pages would be faulted in for every box copied out); a larger one (a single
    saved row longer than that) is the caller's alone."""
    if nbytes > 2 * CHUNK:
        return memoryview(np.empty(nbytes, np.uint8))
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = memoryview(np.empty(nbytes, np.uint8))
    return buf[:nbytes]


@dataclass
class Batch:
    """Chunks of moves, each whole checksum blocks, that lie back to back in one file from
    absolute offset `start`: read with one preadv (runs into their destinations, box rows
    into this thread's scratch), then each chunk's blocks checked and the boxes copied out.
    A part is (move, chunk [a, b), the shard's bytes [lo, hi) it reads)."""
    start: int
    parts: list[tuple[Move, int, int, int, int]]
    hint: bool                      # prefetch it (its file is not streamed)
    nbytes: int = 0

    def follows(self, shard: Shard, lo: int) -> bool:
        first = self.parts[0][0].shard
        return shard.fd == first.fd and shard.start + lo == self.start + self.nbytes and len(self.parts) < IOV

    def add(self, move: Move, a: int, b: int, lo: int, hi: int) -> None:
        self.parts.append((move, a, b, lo, hi))
        self.nbytes += hi - lo

    def run(self, checked: Checked) -> None:
        first = self.parts[0][0].shard
        room = scratch(sum(hi - lo for m, _, _, lo, hi in self.parts if isinstance(m, BoxMove)))
        views, used = [], 0
        for m, a, b, lo, hi in self.parts:
            if isinstance(m, RunMove):
                views.append(m.view(a, b))
            else:
                views.append(room[used:used + hi - lo])
                used += hi - lo
        if self.hint:
            prefetch(first.fd, self.start, self.nbytes)
        readv_into(first.path, first.fd, views, self.start, first.tensor)
        for (m, a, b, lo, hi), view in zip(self.parts, views):
            shard, update = m.shard, ALGORITHMS[m.shard.checksum] if m.shard.sums else None
            for blk in shard.blocks(lo, hi):
                if (shard, blk) not in checked:
                    b_lo, b_hi = shard.block_range(blk)
                    checked.check(shard, blk, update(view[b_lo - lo:b_hi - lo], 0))
            m.finish(a, b, view)


def check_shard(shard: Shard, checked: Checked) -> None:
    """Verify every block of a shard (tools and tests; loads check what they read)."""
    step = shard.step()
    buffer = memoryview(np.empty(min(step, shard.nbytes), np.uint8))
    for lo in range(0, shard.nbytes, step):
        read_checked(shard, buffer[:min(step, shard.nbytes - lo)], lo, checked, True)


def streamed(moves: Sequence[Move]) -> set[int]:
    """The files (by descriptor) that `moves` read without a gap from where they start on to the
    file's end, which the kernel's sequential readahead streams fastest when cold (prefetch)."""
    extents: dict[int, list[tuple[int, int]]] = {}
    sizes: dict[int, int] = {}
    for m in moves:
        extents.setdefault(m.shard.fd, []).append(m.extent())
        sizes[m.shard.fd] = m.shard.file_size
    out = set()
    for fd, spans in extents.items():
        spans.sort()
        end = spans[0][0]
        for lo, hi in spans:
            if lo > end:
                break
            end = max(end, hi)
        else:
            if end >= sizes[fd]:
                out.add(fd)
    return out


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def reader_pool(workers: int) -> ThreadPoolExecutor:
    """The process's reading threads, started once per worker count: a load then pays no thread
    start-up. Keyed by process id too, since threads do not survive a fork."""
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-read")
        return pool


class Mover:
    """Runs moves' chunks and batches on up to `workers` threads as they are submitted.

        with Mover(checked, workers) as mover:
            mover.submit(moves)             # returns at once; the `with` waits, re-raising the first error
    """

    def __init__(self, checked: Checked, workers: int):
        self.checked = checked
        self._pool = reader_pool(workers) if workers > 1 else None
        self._futures: list[Future] = []
        self._batches: dict[int, Batch] = {}       # by file descriptor: the batch still growing

    def submit(self, moves: Sequence[Move]) -> None:
        streams = streamed(moves)
        for m in moves:
            shard = m.shard
            for a, b in m.chunks():
                lo, hi = m.span(a, b)
                if not shard.whole_blocks(lo, hi):
                    self._run(m.run, a, b, self.checked, shard.fd not in streams)
                    continue
                batch = self._batches.get(shard.fd)
                if batch is not None and not batch.follows(shard, lo):
                    self._flush(shard.fd)
                    batch = None
                if batch is None:
                    batch = self._batches[shard.fd] = Batch(shard.start + lo, [], shard.fd not in streams)
                batch.add(m, a, b, lo, hi)
                if batch.nbytes >= CHUNK:
                    self._flush(shard.fd)

    def _flush(self, fd: int) -> None:
        self._run(self._batches.pop(fd).run, self.checked)

    def _run(self, fn, *args) -> None:
        if self._pool is None:
            fn(*args)
        else:
            self._futures.append(self._pool.submit(fn, *args))

    def __enter__(self) -> "Mover":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                for fd in list(self._batches):
                    self._flush(fd)
                for f in self._futures:
                    f.result()
        finally:                            # after an error the queued work is dropped, the running waited for
            for f in self._futures:
                f.cancel()
            wait(self._futures)
