"""The training step anyone would write around a model (AdamW with ms_llm's learning-rate schedule,
cross-entropy, clipping): what bench/torch_overhead.py, bench/gpu_mfu.py and bench/peers.py hold
ms_llm's own step against."""
from __future__ import annotations

from typing import Callable, Optional


def plain_step(model, tc, clip: Optional[Callable] = None, loss_divisor: float = 1.0):
    """step(k, batch (B, T + 1)) -> loss. `clip` defaults to torch's clip_grad_norm_; a loop that
    sums gradients over ranks instead of averaging them divides the loss by the rank count."""
    import torch

    from ms_llm.run import lr_at
    from torch_backend.apply import cross_entropy
    from torch_backend.step import optimizer_args

    clip = clip or torch.nn.utils.clip_grad_norm_
    cls, params, kwargs = optimizer_args(tc.optimizer, list(model.parameters()))
    opt = cls(params, **kwargs)

    def step(k: int, batch: torch.Tensor) -> torch.Tensor:
        for g in opt.param_groups:
            g["lr"] = lr_at(k, tc)
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        (loss / loss_divisor).backward()
        clip(list(model.parameters()), tc.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step
