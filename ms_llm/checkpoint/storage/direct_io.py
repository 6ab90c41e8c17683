"""Writing shard files fast: page-aligned host buffers and O_DIRECT writes.

A snapshot is written once and not read back by the writer, so passing it through the page
cache only costs a memory copy per byte (CPU the background checksums need) and leaves dirty
pages for the kernel to flush. With O_DIRECT the device reads the aligned buffer itself
(DeepSpeed's FastPersist does the same). File systems that refuse O_DIRECT (tmpfs for the
memory tier, some network file systems) get an ordinary buffered write.
"""
from __future__ import annotations

import errno
import mmap
import os
import time

import numpy as np

ALIGN = 4096
CHUNK = 8 << 20                     # bytes per write call (a multiple of ALIGN)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of at least `nbytes`, its length a multiple of ALIGN, backed
    by transparent huge pages where the kernel allows (as numpy does for its large arrays):
    the snapshot copy into it then misses the TLB 512x less often."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # private: THP applies
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype=np.uint8)


def _write_all(fd: int, view: memoryview, rate: float) -> None:
    t0, off = time.perf_counter(), 0
    while off < len(view):
        off += os.write(fd, view[off:off + CHUNK])
        if rate:
            ahead = off / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)


def write_file(path: str | os.PathLike, buffer: np.ndarray, nbytes: int, rate: float = 0.0) -> None:
    """Write buffer[:nbytes] (buffer from aligned_buffer) to `path` and fsync it. `rate` caps
    the bytes per second (0 = as fast as the device goes)."""
    padded = -(-nbytes // ALIGN) * ALIGN
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd, direct = os.open(path, flags, 0o644), False
    try:
        if direct:
            try:
                _write_all(fd, memoryview(buffer)[:padded], rate)
                os.ftruncate(fd, nbytes)            # drop the alignment padding
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd, direct = os.open(path, flags, 0o644), False
        if not direct:
            _write_all(fd, memoryview(buffer)[:nbytes], rate)
        os.fsync(fd)
    finally:
        os.close(fd)
