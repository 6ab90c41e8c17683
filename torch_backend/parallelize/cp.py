"""Context parallelism: attention across the cp group, each rank holding part of the sequence.

Every layer outside attention is per-token, so only the attention core and the rotary
positions change; apply_cp swaps the core of each Attention module (model.Attention.core) and
gives the part the rotary rows of this rank's tokens. TrainStep feeds each rank the same
columns of the batch (cp_positions).

    ring       load-balanced split: the sequence is cut into 2*cp chunks and rank i holds
               chunks i and 2*cp-1-i. K/V blocks travel around the group (isend/irecv); each
               step attends the local queries to one block and merges by log-sum-exp. With
               the zigzag split every step after the first is exactly half a block, unmasked:
               block j < i: all queries vs its first chunk; j > i: the second query chunk vs
               the whole block. Backward runs the ring again; dK/dV travel with the blocks and
               arrive home after cp hops.
    ulysses    contiguous split; all-to-all to head-sharded, full-sequence q/k/v, ordinary
               causal attention on nh/cp heads, all-to-all back (4 all-to-alls per layer).
               K/V heads that do not divide by cp are repeated to the query heads first
               (DeepSpeed-Ulysses does the same for GQA).
    allgather  load-balanced split; K/V all-gathered (backward: reduce-scattered by
               all-to-all, which gloo has), local queries attend under a position mask.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_backend.lower import ContextParallelPlan
from torch_backend.model import Attention, causal_attention


def cp_positions(seq_len: int, cp: int, rank: int, balanced: bool) -> list[int]:
    """Sequence positions rank `rank` of `cp` holds, ascending.

    Balanced (ring, allgather): 2*cp chunks, rank i takes chunks i and 2*cp-1-i, so every
    rank has the same causal work. Worked example, seq_len 8, cp 2 (chunks of 2):
    >>> cp_positions(8, 2, 0, True), cp_positions(8, 2, 1, True)
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> cp_positions(8, 2, 1, False)
    [4, 5, 6, 7]
    """
    if not balanced:
        n = seq_len // cp
        return list(range(rank * n, (rank + 1) * n))
    c = seq_len // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


# ---- communication -------------------------------------------------------------------------

def _ring_exchange(send: torch.Tensor, group: dist.ProcessGroup, tag: int = 0) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank of the ring and receiving the previous rank's.
    Exchanges in flight together (K/V and dK/dV in backward) use different tags."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (me + 1) % n), group, tag),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (me - 1) % n), group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Piece r of `x` along scatter_dim goes to rank r; the pieces received join along gather_dim."""
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.args = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad.contiguous(), group, gather_dim, scatter_dim), None, None, None


class _GatherSequence(torch.autograd.Function):
    """(B, H, T_local, hs) -> every rank's, concatenated in rank order; backward sums each
    rank's share of the gradient back to it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        send = torch.stack(grad.chunk(n, 2)).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ctx.group)
        return recv.sum(0), None


# ---- ring attention ------------------------------------------------------------------------

def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: kv heads repeated to the query heads (head h reads kv head h // group, as HF)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * scale                 # (B, nh, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


# On CPU a block runs through torch's fused flash-attention kernel, which never holds the
# (Tq, Tk) score matrix (bench/context_parallel.py --long: at 1408 local tokens that matrix alone
# outgrew the rest of a rank's memory); elsewhere (CUDA's flash kernels take no fp32) explicitly.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one K/V block: (output, log-sum-exp of the scores), fp32."""
    q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu":
        return _FLASH(q, k, v, 0.0, causal, scale=scale)
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _block_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    """Gradients of one block given the FINAL output and its lse: the softmax over all blocks
    factorises, so each block's share is exact (FlashAttention 2; delta = rowsum(dout * out))."""
    q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu":
        return _FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _block_slices(me: int, owner: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of rank `me`'s queries against rank `owner`'s block under
    the zigzag split; c = chunk length. See the module docstring."""
    if owner == me:
        return slice(None), slice(None), True
    if owner < me:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _reduce_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradient w.r.t. expanded kv heads -> w.r.t. the kv heads (sum over each GQA group)."""
    b, h, t, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, t, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Blocks are computed in fp32 (scores, log-sum-exp, accumulators) whatever autocast says."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, group)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _ring_forward(q, k, v, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp), fp32: the local queries against every rank's K/V block in turn."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    heads, c, scale = q.shape[1], q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    for step in range(n):
        if step < n - 1:                      # the next block travels while this one computes
            nxt, works = _ring_exchange(kv, group)
        rows, cols, causal = _block_slices(me, (me - step) % n, c)
        bo, bl = _block_forward(q[:, :, rows], _expand(kv[0][:, :, cols], heads),
                                _expand(kv[1][:, :, cols], heads), causal, scale)
        new = torch.logaddexp(lse[:, :, rows], bl)
        out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1)
                           + bo * torch.exp(bl - new).unsqueeze(-1))
        lse[:, :, rows] = new
        if step < n - 1:
            for w in works:
                w.wait()
            kv = nxt
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), fp32: the ring again; each block's dK/dV travel with it and arrive home."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    heads, kv_heads, c, scale = q.shape[1], k.shape[1], q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
    dout = dout.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)   # travels with its block
    for step in range(n):
        if step < n - 1:
            nxt, works = _ring_exchange(kv, group)
        rows, cols, causal = _block_slices(me, (me - step) % n, c)
        gq, gk, gv = _block_backward(q[:, :, rows], _expand(kv[0][:, :, cols], heads),
                                     _expand(kv[1][:, :, cols], heads), dout[:, :, rows],
                                     out[:, :, rows], lse[:, :, rows], causal, scale)
        dq[:, :, rows] += gq
        dkv[0][:, :, cols] += _reduce_heads(gk, kv_heads)
        dkv[1][:, :, cols] += _reduce_heads(gv, kv_heads)
        dkv, dkv_works = _ring_exchange(dkv, group, tag=1)   # after the last hop each block is home
        for w in dkv_works:
            w.wait()
        if step < n - 1:
            for w in works:
                w.wait()
            kv = nxt
    return dq, dkv[0], dkv[1]


# ---- the attention cores -------------------------------------------------------------------

def ring_attention(q, k, v, group: dist.ProcessGroup) -> torch.Tensor:
    """q (B, nh, T_local, hs), k/v (B, nkv, T_local, hs), T_local = the rank's two zigzag chunks."""
    return _RingAttention.apply(q, k, v, group)


def ulysses_attention(q, k, v, group: dist.ProcessGroup) -> torch.Tensor:
    """q/k/v on the rank's contiguous slice of the sequence, all heads -> attention over the
    whole sequence on nh/cp heads -> back."""
    n = dist.get_world_size(group)
    if k.shape[1] % n:
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (q, k, v))      # (B, h/cp, T, hs)
    return _AllToAll.apply(causal_attention(q, k, v), group, 2, 1)      # (B, h, T_local, hs)


def allgather_attention(q, k, v, group: dist.ProcessGroup, mask: torch.Tensor) -> torch.Tensor:
    """Local queries against all keys; mask (T_local, T): query position >= key position."""
    k, v = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def apply_cp(part: nn.Module, cp: ContextParallelPlan, group: dist.ProcessGroup, seq_len: int) -> None:
    """Swap every attention core of `part` for the plan's algorithm over `group`, and keep the
    rotary rows of this rank's positions (Attention takes the first T_local of them)."""
    rank = dist.get_rank(group)
    positions = torch.tensor(cp_positions(seq_len, cp.degree, rank, cp.balanced), device=part.rope_cos.device)
    if cp.algorithm == "ring":
        core = partial(ring_attention, group=group)
    elif cp.algorithm == "ulysses":
        core = partial(ulysses_attention, group=group)
    else:
        keys = torch.cat([torch.tensor(cp_positions(seq_len, cp.degree, r, True))
                          for r in range(cp.degree)]).to(positions.device)
        core = partial(allgather_attention, group=group, mask=positions[:, None] >= keys[None, :])
    for module in part.modules():
        if isinstance(module, Attention):
            module.core = core
    part.rope_cos = part.rope_cos[positions]
    part.rope_sin = part.rope_sin[positions]
