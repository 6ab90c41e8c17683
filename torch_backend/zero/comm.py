"""Comm for torch.distributed (gloo on CPU, NCCL on GPU): in-place reduce-scatter and
all-gather on rank-major bucket buffers, async work handles for overlap.

On gloo, whose reduce-scatter and all-gather are several times slower than its
all-reduce and broadcast (bench/zero.py prints the four side by side), a bucket's
reduce-scatter is an all-reduce (the own segment is what the engine reads) and its
all-gather is one broadcast per segment from the rank that owns it."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _All:
    """Several work handles waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class TorchComm:
    def new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        return dist.new_group(ranks)

    @staticmethod
    def _own(buf: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        n = dist.get_world_size(group)
        segment = buf.numel() // n
        return buf.narrow(0, dist.get_rank(group) * segment, segment)

    def all_reduce(self, t, group, async_op=False):
        return dist.all_reduce(t, group=group, async_op=async_op)

    @staticmethod
    def _gloo(group: dist.ProcessGroup) -> bool:
        return dist.get_backend(group) == "gloo"

    def reduce_scatter(self, buf, group, async_op=False):
        if self._gloo(group):
            return dist.all_reduce(buf, group=group, async_op=async_op)
        # Output aliases the input's own segment: NCCL allows it in place.
        return dist.reduce_scatter_single(self._own(buf, group), buf, group=group, async_op=async_op)

    def all_gather_into(self, buf, group, async_op=False):
        if self._gloo(group):
            n = dist.get_world_size(group)
            segment = buf.numel() // n
            works = [dist.broadcast(buf.narrow(0, i * segment, segment), src=dist.get_global_rank(group, i),
                                    group=group, async_op=True) for i in range(n)]
            handle = _All(works)
            if not async_op:
                handle.wait()
            return handle
        return dist.all_gather_single(buf, self._own(buf, group), group=group, async_op=async_op)

    def broadcast(self, t, src, group, async_op=False):
        return dist.broadcast(t.data, src=src, group=group, async_op=async_op)
