"""The collectives the MoE layer (torch_backend/moe.py) moves rows with, each an autograd function
whose backward is its transpose: the all-to-all over ep (uneven split sizes), the gather / reduce-
scatter of rows over the expert-tensor-parallel ranks, and the copy to / reduce from / gather from the
tensor-parallel region the layer's rows are whole over (Megatron-core's mappings).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows x[sum(send[:r]) : ...] go to rank r of `group`; returns the rows received, by source.
    Differentiable: backward is the reverse all-to-all."""
    return _AllToAll.apply(x, send, recv, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The rows of every rank of `group` (sizes[r] from rank r), concatenated in rank order."""
    top = max(sizes)
    padded = x.new_zeros((top,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """x (sum(sizes), ...) summed over `group`; this rank's rows of the sum (sizes[r] for rank r).
    An all-reduce and a slice (gloo has no reduce-scatter)."""
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    start = sum(sizes[:dist.get_rank(group)])
    return x[start:start + sizes[dist.get_rank(group)]]


class GatherFromEtp(torch.autograd.Function):
    """Forward: the rows of every etp rank (sizes[r] from rank r), concatenated; backward: each rank's
    gradient of this rank's rows summed (each computed it from its own slice of the experts' width):
    Megatron's gather from the expert-tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.sizes, ctx.group), None, None


class ReduceScatterToEtp(torch.autograd.Function):
    """Forward: the etp ranks' partial outputs of all their rows summed, this rank's rows kept;
    backward: the gradients of every rank's rows gathered (each slice of the width needs them all)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None


class GatherFromTp(torch.autograd.Function):
    """Forward: the tp ranks' shares of the rows (sizes[r] from rank r), concatenated; backward: this
    rank's share of the gradient, which every tp rank holds whole (what follows is replicated over tp)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        rank = dist.get_rank(group)
        ctx.start, ctx.stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.stop], None, None


def by_expert(counts: torch.Tensor) -> torch.Tensor:
    """counts (sources, E): rows grouped by (source, expert) -> the permutation that groups them by
    (expert, source), so each expert's rows are contiguous (and `index_copy_` by it restores them)."""
    sources, experts = counts.shape
    chunk_expert = torch.arange(experts, device=counts.device).repeat(sources)     # expert of each (s, e) chunk
    return torch.argsort(torch.repeat_interleave(chunk_expert, counts.flatten()), stable=True)


def share_sizes(total: int, parts: int) -> list[int]:
    """Rows in each of `parts` near-equal contiguous shares of `total` rows (the last ones shorter)."""
    size = -(-total // parts)
    return [min((i + 1) * size, total) - min(i * size, total) for i in range(parts)]


def share_of(counts: torch.Tensor, index: int, parts: int) -> tuple[int, int, torch.Tensor]:
    """Share `index` of the `parts` shares (share_sizes) of rows sorted by expert (counts (E,)): its
    rows [start, stop) and how many of each expert's rows it holds."""
    sizes = share_sizes(int(counts.sum()), parts)
    start, stop = sum(sizes[:index]), sum(sizes[:index + 1])
    ends = torch.cumsum(counts, 0)
    held = ends.clamp(max=stop) - (ends - counts).clamp(min=start)
    return start, stop, held.clamp(min=0)


class CopyToTp(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of the tp ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTp(torch.autograd.Function):
    """Forward sums the partial outputs of the tp ranks; backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
