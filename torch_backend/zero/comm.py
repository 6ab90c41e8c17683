"""Comm for torch.distributed (gloo on CPU, NCCL on GPU): in-place reduce-scatter and
all-gather on rank-major bucket buffers, async work handles for overlap."""
from __future__ import annotations

import torch
import torch.distributed as dist


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

    def reduce_scatter(self, buf, group, async_op=False):
        # Output aliases the input's own segment: both gloo and NCCL allow it in place.
        return dist.reduce_scatter_single(self._own(buf, group), buf, group=group, async_op=async_op)

    def all_gather_into(self, buf, group, async_op=False):
        return dist.all_gather_single(buf, self._own(buf, group), group=group, async_op=async_op)

    def broadcast(self, t, src, group, async_op=False):
        return dist.broadcast(t.data, src=src, group=group, async_op=async_op)
