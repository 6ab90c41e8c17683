"""The shared ZeRO engine (ms_llm.zero) on MindSpore: its device protocol and a data-parallel
runner for PyNative training loops.

MindSpore on CPU has AllReduce, AllGather and Broadcast but no ReduceScatter, so the
reduce-scatter of a bucket is an AllReduce whose own segment is kept. Tensor updates are
functional (new tensors) except stores into buffers and parameters, which go through
setitem: it writes in place, so compiled (ms.jit) graphs holding the parameters see the
new values (set_data would hand them a stale copy). Only ZeRO-3's release / materialize
swap a parameter's data, which is why its runner stays in PyNative.

    runner = MsZeroDataParallel(loss_cell, zplan, rank, EngineConfig.from_job(strategy, train))
    loss = runner.backward(inputs, labels)     # grads of one micro-batch into the engine
    runner.step(lr)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank

from ms_llm.zero.engine import EngineConfig, ZeroEngine
from ms_llm.zero.partition import Slot
from ms_llm.zero.plan import OwnedPiece, ZeroPlan
from ms_llm.zero.protocol import SGD, AdamW, Ranges

DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


class _Done:
    """MindSpore's CPU collectives return when their result is ready."""
    def wait(self) -> None:
        return None


def _store(dst: Tensor, value: Tensor) -> None:
    """Write `value` into `dst` (a buffer or a Parameter) in place."""
    dst[:] = value.reshape(dst.shape).astype(dst.dtype)


class MsComm:
    """Groups are MindSpore communication group names, created on their members only."""

    def __init__(self):
        self.rank, self.world = get_rank(), get_group_size()
        self._members: dict[str, list[int]] = {}
        self._ops: dict[tuple[str, str], object] = {}

    def new_group(self, ranks: list[int]) -> Optional[str]:
        if self.rank not in ranks:
            return None
        if list(ranks) == list(range(self.world)):
            name = GlobalComm.WORLD_COMM_GROUP
        else:
            name = "zero_" + "_".join(map(str, ranks))
            if name not in self._members:
                create_group(name, list(ranks))
        self._members[name] = list(ranks)
        return name

    def _op(self, kind: str, group: str):
        key = (kind, group)
        if key not in self._ops:
            self._ops[key] = ops.AllReduce(group=group) if kind == "all_reduce" else ops.AllGather(group=group)
        return self._ops[key]

    def all_reduce(self, t, group, async_op=False):
        _store(t, self._op("all_reduce", group)(t))
        return _Done()

    def reduce_scatter(self, buf, group, async_op=False):
        # No ReduceScatter kernel on CPU: the all-reduced bucket holds every segment's sum.
        return self.all_reduce(buf, group, async_op)

    def all_gather_into(self, buf, group, async_op=False):
        members = self._members[group]
        segment = buf.shape[0] // len(members)
        index = members.index(self.rank)
        own = buf[index * segment:(index + 1) * segment]
        _store(buf, self._op("all_gather", group)(own))
        return _Done()

    def broadcast(self, t, src, group, async_op=False):
        out = ops.Broadcast(src, group=group)((t,))[0]
        _store(t, out)
        return _Done()


def _pieces(value: Tensor, slot: Slot) -> list[Tensor]:
    value = value.reshape(slot.local_shape)
    if slot.zero_dim is None:
        return [value.reshape(-1)]
    return [p.reshape(-1) for p in ops.split(value, value.shape[slot.zero_dim] // slot.parts, slot.zero_dim)]


class MsOps:
    def __init__(self):
        self._shapes: dict[str, tuple] = {}      # released parameters: their shape and dtype

    def zeros(self, numel: int, dtype: str, host: bool = False) -> Tensor:
        return ops.zeros((numel,), DTYPES[dtype])

    def empty(self, numel: int, dtype: str) -> Tensor:
        return ops.zeros((numel,), DTYPES[dtype])

    def free(self, buf: Tensor) -> None:
        """MindSpore's memory pool reuses the storage once the tensor is dropped."""

    def read(self, buf: Tensor, start: int, numel: int) -> Tensor:
        return buf[start:start + numel]

    def write(self, buf: Tensor, start: int, src: Tensor) -> Tensor:
        flat = src.reshape(-1)
        buf[start:start + flat.shape[0]] = flat.astype(buf.dtype)
        return buf

    def add(self, dst: Tensor, src: Tensor) -> Tensor:
        return dst + src.astype(dst.dtype)

    def scale(self, t: Tensor, factor: float) -> Tensor:
        return t * factor

    def cast(self, t: Tensor, dtype: str, host: bool = False) -> Tensor:
        return t.reshape(-1).astype(DTYPES[dtype]).copy()     # astype to the same dtype aliases

    def pack(self, buf, start, segment, slot, value, accumulate):
        for i, piece in enumerate(_pieces(value, slot)):
            at = start + i * segment + slot.offset
            if accumulate:
                piece = buf[at:at + slot.numel] + piece.astype(buf.dtype)
            buf[at:at + slot.numel] = piece.astype(buf.dtype)
        return buf

    def pack_own(self, buf, start, segment, slot, index, value):
        piece = _pieces(value, slot)[index if slot.zero_dim is not None else 0]
        at = start + index * segment + slot.offset
        buf[at:at + slot.numel] = piece.astype(buf.dtype)
        return buf

    def unpack(self, buf, start, segment, slot, param) -> None:
        shape = slot.piece_shape
        pieces = [buf[start + i * segment + slot.offset:start + i * segment + slot.offset + slot.numel].reshape(shape)
                  for i in range(slot.parts)]
        full = pieces[0] if slot.zero_dim is None else ops.cat(pieces, slot.zero_dim)
        _store(param, full)

    def sum_squares(self, t, ranges) -> Tensor:
        total = ops.zeros((1,), ms.float32)
        for a, b in ranges:
            piece = t[a:b].astype(ms.float32)
            total = total + (piece * piece).sum()
        return total

    def bind(self, buf, slots, params, grads) -> bool:
        """MindSpore parameters cannot be views of another tensor's storage."""
        return False

    def clear(self, t: Tensor) -> Tensor:
        return ops.zeros_like(t)

    def item(self, t: Tensor) -> float:
        return float(t.reshape(-1)[0].item())

    def nbytes(self, t: Tensor) -> int:
        return int(t.nbytes)

    def release(self, param) -> None:
        self._shapes[param.name] = (param.shape, param.dtype)
        param.set_data(ops.zeros((0,), param.dtype))

    def materialize(self, param) -> None:
        if param.name in self._shapes and param.shape != self._shapes[param.name][0]:
            shape, dtype = self._shapes[param.name]
            param.set_data(ops.zeros(shape, dtype))

    def adamw(self, p, g, m, v, step, lr, hp: AdamW, decay: Ranges = None):
        """torch.optim.AdamW's update (see TorchOps.adamw), written functionally."""
        factor, step_size, bias_correction2_sqrt = hp.scalars(step, lr)
        if hp.weight_decay != 0:
            p = _on_ranges(p, decay, lambda a, b: p[a:b] * factor)
        m = m + (g - m) * (1 - hp.beta1)
        v = v * hp.beta2 + g * g * (1 - hp.beta2)
        denom = ops.sqrt(v) / bias_correction2_sqrt + hp.eps
        return p - m / denom * step_size, m, v

    def sgd(self, p, g, lr, hp: SGD, decay: Ranges = None):
        if hp.weight_decay != 0:
            g = _on_ranges(g, decay, lambda a, b: g[a:b] + p[a:b] * hp.weight_decay)
        return p - g * lr


def _on_ranges(t: Tensor, ranges: Ranges, inside) -> Tensor:
    """t with its `ranges` replaced by inside(a, b) (None: all of t), the rest as it is: no
    writable views here, so the pieces are concatenated."""
    n = t.shape[0]
    if ranges is None or tuple(ranges) == ((0, n),):
        return inside(0, n)
    pieces, at = [], 0
    for a, b in ranges:
        pieces += [t[at:a], inside(a, b)]
        at = b
    pieces.append(t[at:])
    return ops.cat([piece for piece in pieces if piece.shape[0]])


class _Scaled(nn.Cell):
    def __init__(self, loss_cell: nn.Cell):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell

    def construct(self, scale, *inputs):
        return self.loss_cell(*inputs) * scale


class MsZeroDataParallel:
    """A MindSpore loss cell trained data parallel by the shared engine.

    Stages 0-2: the gradient function is compiled once (ms.jit); the engine's bucketing,
    collectives and optimizer run on the gradients it returns. Stage 3: the gradient
    function runs in PyNative, where Cell hooks gather each unit before its forward and
    backward and free it after (a compiled graph would keep the parameter storage).
    On CPU it makes the process's PyNative ops blocking (see __init__)."""

    def __init__(self, loss_cell: nn.Cell, zplan: ZeroPlan, rank: int, config: EngineConfig,
                 net: Optional[nn.Cell] = None):
        if ms.get_context("device_target") == "CPU":
            # The engine issues many small ops between collectives; on CPU the asynchronous
            # PyNative pipeline's threads spin while waiting for them (about 3.5x the CPU time).
            # Run each op on the calling thread instead: the same kernels in the same order.
            ms.runtime.launch_blocking()
        self.loss_cell = loss_cell
        self.weights: list[Parameter] = loss_cell.trainable_params()
        params = {p.name: p for p in self.weights}
        names = {v: k for k, v in DTYPES.items()}
        zplan.check_dtypes({name: names.get(p.dtype, str(p.dtype)) for name, p in params.items()})
        self.engine = ZeroEngine(zplan, rank, params, MsComm(), MsOps(), config, get_group_size())
        grad_fn = ms.value_and_grad(_Scaled(loss_cell), None, self.weights)
        if self.engine.gather is None:
            self.grad_fn = ms.jit(grad_fn)
        else:
            if net is None:
                raise ValueError("MsZeroDataParallel: ZeRO-3 needs `net`, the model cell whose sub-cells are "
                                 "named like the plan's units (model.layers.N, ...), to hook them")
            self._hook_units(net)
            self.grad_fn = grad_fn

    def _hook_units(self, net: nn.Cell) -> None:
        cells = dict(net.cells_and_names())
        gather = self.engine.gather
        for unit in gather.units:
            missing = [m for m in unit.modules if m not in cells]
            if missing:
                raise KeyError(f"ZeRO-3: the model has no cell {missing[0]!r} for unit {unit.name}")
            for i, name in enumerate(unit.modules):
                cell = cells[name]
                cell.register_forward_pre_hook(lambda c, args, u=unit.name: gather.before_forward(u))
                cell.register_backward_pre_hook(lambda c, grad, u=unit.name: self._before_backward(u))
                if i == len(unit.modules) - 1:
                    cell.register_forward_hook(lambda c, args, out, u=unit.name: gather.after_forward(u))
                if i == 0:   # the unit's first cell is the last one backward runs through
                    cell.register_backward_hook(lambda c, gin, gout, u=unit.name: gather.after_backward(u))

    def _before_backward(self, unit: str) -> None:
        self.engine.gather.before_backward(unit)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():
            yield

    def backward(self, *inputs, scale: float = 1.0) -> Tensor:
        """Loss of one micro-batch times `scale` (1 / micro-batches when accumulating); its
        gradients go to the engine, last parameter first (the order autograd finishes them
        in, so buckets reduce in the planned order)."""
        loss, grads = self.grad_fn(Tensor(scale, ms.float32), *inputs)
        for p, g in reversed(list(zip(self.weights, grads))):
            self.engine.on_grad(p.name, g)
        self.engine.finish_backward()
        return loss

    def step(self, lr: float) -> Optional[float]:
        return self.engine.step(lr)

    def model_state_bytes(self) -> dict[str, int]:
        return self.engine.model_state_bytes()

    def owned(self) -> tuple[OwnedPiece, ...]:
        return self.engine.zplan.owned(self.engine.rank)

