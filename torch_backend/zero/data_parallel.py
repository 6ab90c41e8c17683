"""ZeroDataParallel: a torch model trained data parallel by the shared ZeRO engine.

    dp = ZeroDataParallel(model, zplan, rank, EngineConfig.from_job(strategy, train), device)
    for micro in range(n):
        with dp.no_sync() if micro < n - 1 else nullcontext():
            loss_fn(model(x[micro])).backward()
    dp.step(lr)

Gradients leave autograd through post-accumulate-grad hooks (p.grad is packed into its
bucket and dropped, or, in unsharded buckets, already is a view of it and stays), the end
of backward is an autograd callback, and under ZeRO-3 module
hooks gather each unit's parameters before its forward and backward and free them after.
Tensor-parallel (DTensor) parameters are handled through their local shards, which is what
the plan partitions.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ms_llm.zero.engine import EngineConfig, ZeroEngine
from ms_llm.zero.plan import OwnedPiece, ZeroPlan
from torch_backend.dist import is_dtensor
from torch_backend.zero.comm import TorchComm
from torch_backend.zero.ops import DTYPES, TorchOps

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor: a tensor-parallel DTensor's local shard (sharing its storage)."""
    return t.to_local() if is_dtensor(t) else t


class ZeroDataParallel:
    """`model`: the rank's module, or its model chunks (virtual pipeline stages), whose
    parameter and module names are the plan's."""

    def __init__(self, model: nn.Module | list[nn.Module], zplan: ZeroPlan, rank: int, config: EngineConfig,
                 device: torch.device | str = "cpu"):
        self.parts = list(model) if isinstance(model, (list, tuple)) else [model]
        named = {name: p for part in self.parts for name, p in part.named_parameters()}
        with torch.no_grad():
            params = {name: _local(p) for name, p in named.items()}
        zplan.check_dtypes({name: DTYPE_NAMES[p.dtype] for name, p in params.items()})
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.engine = ZeroEngine(zplan, rank, params, TorchComm(), TorchOps(torch.device(device)), config, world)
        self._queued = False
        self._handles = []
        for name in self.engine.names:
            self._handles.append(named[name].register_post_accumulate_grad_hook(self._grad_hook(name)))
        if self.engine.gather is not None:
            self._hook_units()

    # ---- hooks -------------------------------------------------------------------------
    def _queue_finish(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        self.engine.finish_backward()

    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            self._queue_finish()
            grad = p.grad
            if is_dtensor(grad) and grad.placements != p.placements:
                # e.g. a vocab-parallel embedding's gradient arrives replicated or partial
                grad = grad.redistribute(p.device_mesh, p.placements)
            if not self.engine.on_grad(name, _local(grad)):
                p.grad = None
        return hook

    def _hook_units(self) -> None:
        gather = self.engine.gather
        for unit in gather.units:
            modules = [self._module(m) for m in unit.modules]
            for i, module in enumerate(modules):
                last = i == len(modules) - 1
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit.name)))
                self._handles.append(module.register_forward_hook(self._post_forward(unit.name, last)))

    def _module(self, name: str) -> nn.Module:
        for part in self.parts:
            try:
                return part.get_submodule(name)
            except AttributeError:
                continue
        raise KeyError(f"ZeRO-3: no module {name!r} in the model chunks of this rank")

    def _pre_forward(self, unit: str):
        def hook(module, args) -> None:
            self.engine.gather.before_forward(unit)
        return hook

    def _post_forward(self, unit: str, last: bool):
        def pre_backward(grad: torch.Tensor) -> None:
            self._queue_finish()
            self.engine.gather.before_backward(unit)

        def hook(module, args, output) -> None:
            if torch.is_grad_enabled():
                outputs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outputs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(pre_backward)
            if last:
                self.engine.gather.after_forward(unit)
        return hook

    # ---- the data-parallel interface ---------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():
            yield

    def step(self, lr: float, loss_scale: Optional[float] = None) -> Optional[float]:
        """Optimizer step on the owned shards (after clipping); returns the pre-clip gradient
        norm when clipping or loss scaling is on. With `loss_scale` (fp16) a non-finite norm
        skips the step on every rank (ZeroEngine.step)."""
        return self.engine.step(lr, loss_scale)

    def model_state_bytes(self) -> dict[str, int]:
        return self.engine.model_state_bytes()

    def owned(self) -> tuple[OwnedPiece, ...]:
        return self.engine.zplan.owned(self.engine.rank)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
