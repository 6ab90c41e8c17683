"""Block checksums of checkpoint bytes: the one place that says how they are computed.

New checkpoints record CRC32C (Castagnoli) per block under the shard key "crc32c": the
`crc32c` package computes it with the CPU's CRC instruction (SSE4.2 / ARMv8), several times
faster than zlib.crc32, and releases the GIL on large buffers, so checking keeps up with
reading. Checkpoints written before record zlib's CRC32 under "crc32" and are checked with
it. A shard with neither (a foreign file an importer indexed) has nothing to check.
"""
from __future__ import annotations

import zlib
from typing import Callable, Union

import crc32c

Buffer = Union[bytes, bytearray, memoryview]

# Shard key in the index -> function(data, running value) -> checksum.
ALGORITHMS: dict[str, Callable[[Buffer, int], int]] = {
    "crc32c": crc32c.crc32c,
    "crc32": zlib.crc32,
}
DEFAULT = "crc32c"


def block_checksums(data: Buffer, block: int, algorithm: str = DEFAULT) -> list[int]:
    """One checksum per `block` bytes of `data` (the last block may be shorter)."""
    fn, view = ALGORITHMS[algorithm], memoryview(data)
    return [fn(view[i:i + block], 0) for i in range(0, len(view), block)]
