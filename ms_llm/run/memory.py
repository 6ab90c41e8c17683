"""The per-rank memory limit (train.memory_limit_gb) and the one-line error when a step passes it.

On a host the limit is RLIMIT_DATA: the kernel refuses every private writable mapping past it
(heap, the allocators' mmap'd blocks, thread stacks), so an allocation fails where a machine
with that much memory would run out, instead of the OOM killer ending the process or its
neighbours. It is set once the worker has built its model, at what the worker holds then plus
the limit, so the budget is what training steps take: gradients, optimizer state, activations,
communication buffers. What came before is the framework's and the layout's, not the sequence's:
libraries (~0.2 GB), the parameters, and each process group's threads, whose stacks RLIMIT_DATA
counts though they stay untouched (8 MB each; a cp4 rank's groups start ~20 threads, a single
process ~6). A device backend caps its allocator instead (torch: the CUDA caching allocator).
"""
from __future__ import annotations

import contextlib
import ctypes
import resource
from typing import Iterator

from ms_llm.errors import OutOfMemory

# What an allocation failure says: torch's CPU allocator, torch / MindSpore device allocators.
OOM_TEXTS = ("can't allocate memory", "not enough memory", "out of memory", "Out of memory")


def data_memory_bytes() -> int:
    """This process's data memory now (VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmData line")


def _exact_mappings() -> None:
    """glibc: every allocation past 64 KiB its own mapping, unmapped when freed (mallopt
    M_MMAP_THRESHOLD, which also stops glibc raising that threshold as blocks are freed). Tensors
    then leave no heap high-water mark or fragments behind, so the limit counts live memory and a
    run at the edge of it passes or fails the same way each time."""
    with contextlib.suppress(OSError, AttributeError):           # not glibc: its own allocator's behaviour
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)          # M_MMAP_THRESHOLD


def limit_host_memory(gb: float) -> int:
    """Let this process allocate `gb` more data memory than it holds now, no more (RLIMIT_DATA,
    soft limit; a lower hard limit stays). Returns the limit in bytes."""
    _exact_mappings()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_memory_bytes() + int(gb * 2**30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and any(t in str(exc) for t in OOM_TEXTS))


@contextlib.contextmanager
def out_of_memory_error(limit_gb: float, rank: int, step: int) -> Iterator[None]:
    """Turn an allocation failure inside the block into OutOfMemory: one line naming the limit
    and what to change, instead of a traceback from inside the framework."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        first = next((part.strip() for part in str(exc).replace("\n", ". ").split(". ")
                      if any(t in part for t in OOM_TEXTS)), type(exc).__name__)
        under = f"train.memory_limit_gb = {limit_gb:g}" if limit_gb else "this machine's memory"
        raise OutOfMemory(f"rank {rank} ran out of memory in step {step + 1} under {under} ({first}); raise "
                          "train.memory_limit_gb, split the sequence over more ranks (strategy.cp) or the layers "
                          "(strategy.pp, recompute), or lower train.seq_len / micro_batch_size") from None
