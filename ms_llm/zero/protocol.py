"""The device protocol the ZeRO engine runs over: collectives plus a few tensor operations.

Each backend implements it natively (torch_backend/zero/comm.py with torch.distributed,
ms_llm/mindspore/zero.py with mindspore.communication); the engine never touches numpy
on the hot path. Tensors are opaque to the engine.

Value semantics: operations that produce a tensor return it, and the engine keeps the
returned object. Backends whose slices are views (torch) update in place and return the
same tensor; backends without writable views (MindSpore on CPU) return new tensors and
write sub-ranges with explicit stores. Buffers are flat (1-D) tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from ms_llm.zero.partition import Slot

Tensor = Any
Group = Any
# Element ranges [a, b) of a flat tensor that weight decay applies to (the engine's per-parameter
# decay: OptimizerConfig.weight_decay_1d false exempts the 1-D parameters' pieces); None: all of it.
Ranges = Optional[tuple[tuple[int, int], ...]]


class Handle(Protocol):
    """An issued collective; wait() returns once its output may be read."""
    def wait(self) -> None: ...


class Comm(Protocol):
    """Collectives over a group (from new_group). Bucket buffers are rank-major: segment
    i of a buffer of n = parts * segment elements belongs to the group's i-th rank."""

    def new_group(self, ranks: list[int]) -> Group: ...

    def all_reduce(self, t: Tensor, group: Group, async_op: bool = False) -> Handle:
        """Sum `t` over the group, in place."""

    def reduce_scatter(self, buf: Tensor, group: Group, async_op: bool = False) -> Handle:
        """Afterwards this rank's segment of `buf` holds the group's sum of that segment;
        the other segments are undefined (backends without ReduceScatter all-reduce)."""

    def all_gather_into(self, buf: Tensor, group: Group, async_op: bool = False) -> Handle:
        """Fill every segment of `buf` from the rank that owns it (its own segment is the input)."""

    def broadcast(self, t: Tensor, src: int, group: Group, async_op: bool = False) -> Handle:
        """Copy global rank `src`'s `t` to the group, in place."""


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW semantics (amsgrad off): decoupled decay, bias-corrected moments."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def scalars(self, step: int, lr: float) -> tuple[float, float, float]:
        """(weight-decay factor, step size, sqrt of the second bias correction) of update
        `step`, computed as torch.optim.AdamW does, so every backend's update matches it."""
        return 1 - lr * self.weight_decay, lr / (1 - self.beta1 ** step), (1 - self.beta2 ** step) ** 0.5


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD semantics without momentum: weight decay added to the gradient."""
    weight_decay: float


class TensorOps(Protocol):
    def zeros(self, numel: int, dtype: str, host: bool = False) -> Tensor:
        """A flat zero tensor on the device (or in host memory for offloaded states)."""

    def empty(self, numel: int, dtype: str) -> Tensor:
        """A flat device tensor whose every element the engine overwrites before reading it."""

    def free(self, buf: Tensor) -> None:
        """The engine is done with a flat buffer it got from zeros / cast (backends may reuse it)."""

    def read(self, buf: Tensor, start: int, numel: int) -> Tensor:
        """buf[start:start + numel]: a view where the backend has them, else a copy."""

    def write(self, buf: Tensor, start: int, src: Tensor) -> Tensor:
        """Store `src` (cast to buf's dtype) at buf[start:], return buf."""

    def add(self, dst: Tensor, src: Tensor) -> Tensor:
        """dst + src (src cast to dst's dtype), in place where possible."""

    def scale(self, t: Tensor, factor: float) -> Tensor:
        """t * factor, in place where possible."""

    def cast(self, t: Tensor, dtype: str, host: bool = False) -> Tensor:
        """A new tensor with t's values in `dtype`, on the device or in host memory."""

    def pack(self, buf: Tensor, start: int, segment: int, slot: Slot, value: Tensor, accumulate: bool) -> Tensor:
        """Store (or add) the TP-local tensor `value` into the bucket at buf[start:]: chunk i
        along slot.zero_dim at start + i * segment + slot.offset. Return buf. A `value` that
        is already its place in the bucket (bound by `bind`) is left as it is."""

    def pack_own(self, buf: Tensor, start: int, segment: int, slot: Slot, index: int, value: Tensor) -> Tensor:
        """Like pack, but only chunk `index` (this rank's), into segment `index`."""

    def unpack(self, buf: Tensor, start: int, segment: int, slot: Slot, param: Tensor) -> None:
        """Assemble the parameter from every segment of the bucket and store it into `param`."""

    def bind(self, buf: Tensor, slots: tuple[Slot, ...], params: list[Tensor], grads: bool) -> bool:
        """Make each parameter of an unsharded bucket (its gradient, with `grads`) a view of
        its place in `buf`, so the model reads what the engine writes and autograd
        accumulates where the engine reduces. False, binding nothing, where the backend
        cannot alias every one of them."""

    def clear(self, t: Tensor) -> Tensor:
        """t filled with zeros, in place where possible."""

    def sum_squares(self, t: Tensor, ranges: tuple[tuple[int, int], ...]) -> Tensor:
        """Sum of squares of t[a:b] over `ranges`, as a one-element float32 tensor."""

    def item(self, t: Tensor) -> float: ...

    def nbytes(self, t: Tensor) -> int:
        """Bytes of storage the tensor holds now (0 for a released parameter)."""

    def release(self, param: Tensor) -> None:
        """Drop the parameter's storage but keep the parameter object (ZeRO-3)."""

    def materialize(self, param: Tensor) -> None:
        """Give a released parameter storage again (values are written by unpack)."""

    def adamw(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: int, lr: float, hp: AdamW,
              decay: Ranges = None) -> tuple[Tensor, Tensor, Tensor]:
        """One AdamW update of flat p with gradient g, weight decay on the `decay` ranges of p;
        returns (p, m, v)."""

    def sgd(self, p: Tensor, g: Tensor, lr: float, hp: SGD, decay: Ranges = None) -> Tensor:
        """One SGD update of flat p, weight decay on the `decay` ranges of p."""
