"""The reference for train.optimizer.weight_decay_1d false: torch.optim.AdamW with Megatron-LM's
default param groups (no weight decay on biases and 1-D parameters), the whole global batch in
one process. Every optimizer path of both backends must equal it; the same loop with one group
(decay on everything) is the control that shows a test can tell the two apart."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ms_llm.config.train import OptimizerConfig
from torch_backend.model import Transformer

from decay_cases import MICRO, MODEL, OPT, batches, job


def param_groups(model: torch.nn.Module, exempt: bool) -> list[dict]:
    """Megatron-LM's default no_weight_decay_cond (biases and 1-D parameters), or one group."""
    named = list(model.named_parameters())
    if not exempt:
        return [{"params": [p for _, p in named]}]
    free = [n.endswith(".bias") or p.ndim == 1 for n, p in named]
    assert any(free) and not all(free)
    return [{"params": [p for (_, p), f in zip(named, free) if not f]},
            {"params": [p for (_, p), f in zip(named, free) if f], "weight_decay": 0.0}]


def train(model: torch.nn.Module, steps: np.ndarray, micro_batches: int, opt: OptimizerConfig,
          exempt: bool = True) -> list[float]:
    """AdamW steps over `steps` (steps, rows, seq + 1), each split into `micro_batches`, clipped to
    opt.grad_clip; returns the losses. `model` is trained in place."""
    optim = torch.optim.AdamW(param_groups(model, exempt), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    losses = []
    for step in torch.from_numpy(steps):
        total = 0.0
        for mb in step.chunk(micro_batches):
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / micro_batches
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return losses


def reference(model: dict = MODEL, exempt: bool = True) -> tuple[dict[str, np.ndarray], list[float]]:
    """decay_cases' job trained by `train` from the trainer's initial weights: (parameters, losses)."""
    j = job({}, model)
    ref = Transformer(j.model)
    ref.init_weights(j.train.seed)
    losses = train(ref, batches(j.model.vocab_size), MICRO, OptimizerConfig(**OPT), exempt)
    return {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}, losses


def worst(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    """Largest absolute difference over every parameter, both holding the same names."""
    assert set(got) == set(want), set(got) ^ set(want)
    return max(float(np.abs(np.asarray(got[n]) - w).max()) for n, w in want.items())
