"""TensorOps for torch: slices are views, every update is in place, no host round trips
except the offloaded optimizer states the strategy asks for."""
from __future__ import annotations

import torch
from torch import nn

from ms_llm.zero.partition import Slot
from ms_llm.zero.protocol import SGD, AdamW, Ranges

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _chunks(t: torch.Tensor, slot: Slot) -> torch.Tensor:
    """(parts, *piece_shape) view of a TP-local tensor: chunk i along the ZeRO dim first."""
    if slot.zero_dim is None:
        return t.view((1,) + tuple(slot.local_shape))
    d, shape = slot.zero_dim, tuple(slot.local_shape)
    split = shape[:d] + (slot.parts, shape[d] // slot.parts) + shape[d + 1:]
    return t.view(split).movedim(d, 0)


def _columns(buf: torch.Tensor, start: int, segment: int, slot: Slot) -> torch.Tensor:
    """(parts, *piece_shape) view of the slot's piece in every segment of a bucket."""
    rows = buf.narrow(0, start, slot.parts * segment).view(slot.parts, segment)
    return rows.narrow(1, slot.offset, slot.numel).view((slot.parts,) + slot.piece_shape)


class TorchOps:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._restoring: set[int] = set()
        # Bucket buffers come and go every step; keeping freed ones spares the allocator
        # (on CPU, fresh pages for every multi-megabyte buffer).
        self._pool: dict[tuple, list[torch.Tensor]] = {}

    def _where(self, host: bool) -> torch.device:
        return torch.device("cpu") if host else self.device

    def _take(self, numel: int, dtype: torch.dtype, host: bool) -> tuple[torch.Tensor, bool]:
        free = self._pool.get((numel, dtype, self._where(host)))
        if free:
            return free.pop(), True
        pin = host and self.device.type == "cuda"
        return torch.empty(numel, dtype=dtype, device=self._where(host), pin_memory=pin), False

    def zeros(self, numel: int, dtype: str, host: bool = False) -> torch.Tensor:
        return self._take(numel, DTYPES[dtype], host)[0].zero_()

    def empty(self, numel: int, dtype: str) -> torch.Tensor:
        return self._take(numel, DTYPES[dtype], False)[0]

    def free(self, buf: torch.Tensor) -> None:
        self._pool.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)

    def read(self, buf: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        return buf.narrow(0, start, numel)

    def write(self, buf: torch.Tensor, start: int, src: torch.Tensor) -> torch.Tensor:
        dst = buf.narrow(0, start, src.numel())
        if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype or dst.device != src.device:
            dst.copy_(src.reshape(-1), non_blocking=True)
        return buf

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return dst.add_(src)

    def scale(self, t: torch.Tensor, factor: float) -> torch.Tensor:
        return t.mul_(factor)

    def cast(self, t: torch.Tensor, dtype: str, host: bool = False) -> torch.Tensor:
        out, _ = self._take(t.numel(), DTYPES[dtype], host)
        return out.copy_(t.reshape(-1), non_blocking=True)

    @torch.no_grad()
    def pack(self, buf, start, segment, slot, value, accumulate):
        if (slot.parts == 1 and value.dtype == buf.dtype
                and value.data_ptr() == buf.data_ptr() + (start + slot.offset) * buf.element_size()):
            return buf                                  # a bound gradient: already in place
        cols, src = _columns(buf, start, segment, slot), _chunks(value.detach(), slot)
        if accumulate:
            cols.add_(src)
        else:
            cols.copy_(src)
        return buf

    @torch.no_grad()
    def pack_own(self, buf, start, segment, slot, index, value):
        dst = buf.narrow(0, start + index * segment + slot.offset, slot.numel).view(slot.piece_shape)
        dst.copy_(_chunks(value.detach(), slot)[index if slot.zero_dim is not None else 0])
        return buf

    @torch.no_grad()
    def unpack(self, buf, start, segment, slot, param) -> None:
        target = _chunks(param.data, slot)
        if id(param) in self._restoring:
            # Re-gathered for backward: autograd saved this parameter for the current graph,
            # so the rewrite must not count as an in-place change of a saved tensor.
            self._restoring.discard(id(param))
            with torch.autograd._unsafe_preserve_version_counter(param):
                target.copy_(_columns(buf, start, segment, slot))
        else:
            target.copy_(_columns(buf, start, segment, slot))

    @torch.no_grad()
    def bind(self, buf, slots, params, grads) -> bool:
        """Only plain parameters are rebound. A tensor-parallel DTensor's local shard (which
        even passes isinstance(_, nn.Parameter)) is not the tensor autograd accumulates into."""
        if not all(type(p) is nn.Parameter and p.dtype == buf.dtype and p.device == buf.device for p in params):
            return False
        for slot, p in zip(slots, params):
            view = buf.narrow(0, slot.offset, slot.numel).view(slot.local_shape)
            if grads:
                p.grad = view
            else:
                p.data = view
        return True

    def clear(self, t: torch.Tensor) -> torch.Tensor:
        return t.zero_()

    def sum_squares(self, t: torch.Tensor, ranges) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float32, device=t.device)
        for a, b in ranges:
            piece = t[a:b].float()
            total += torch.dot(piece, piece)
        return total.to(self.device)

    def item(self, t: torch.Tensor) -> float:
        return float(t.item())

    def nbytes(self, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def release(self, param: torch.Tensor) -> None:
        param.data.untyped_storage().resize_(0)

    def materialize(self, param: torch.Tensor) -> None:
        storage = param.data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(param.numel() * param.element_size())
            self._restoring.add(id(param))

    @torch.no_grad()
    def adamw(self, p, g, m, v, step, lr, hp: AdamW, decay: Ranges = None):
        """torch.optim.AdamW's single-tensor update, operation for operation (decay on views of p)."""
        factor, step_size, bias_correction2_sqrt = hp.scalars(step, lr)
        if hp.weight_decay != 0:
            for a, b in _whole(decay, p):
                p[a:b].mul_(factor)
        m.lerp_(g, 1 - hp.beta1)
        v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
        # The bucket-sized denominator comes from the pool: a fresh one every step costs the
        # allocator more than the update (on CPU, page faults on every multi-megabyte buffer).
        denom, _ = self._take(v.numel(), v.dtype, v.device.type == "cpu" and self.device.type != "cpu")
        denom = torch.sqrt(v, out=denom.view_as(v)).div_(bias_correction2_sqrt).add_(hp.eps)
        p.addcdiv_(m, denom, value=-step_size)
        self.free(denom.view(-1))
        return p, m, v

    @torch.no_grad()
    def sgd(self, p, g, lr, hp: SGD, decay: Ranges = None):
        """torch.optim.SGD without momentum: p -= lr * (g + wd * p), wd on the decay ranges."""
        if hp.weight_decay != 0:
            g = g.clone()
            for a, b in _whole(decay, p):
                g[a:b].add_(p[a:b], alpha=hp.weight_decay)
        return p.add_(g, alpha=-lr)


def _whole(decay: Ranges, t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    return ((0, t.numel()),) if decay is None else decay
