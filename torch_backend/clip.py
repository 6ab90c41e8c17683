"""Global gradient-norm clipping over plain and DTensor gradients of every pipeline stage.

Gradients are grouped by (mesh, placements): one norm per group (a DTensor norm is reduced
over the axes that shard it), the squares summed, then summed over pipeline stages,
which hold disjoint parameters but for the embedding copy of the MTP modules' stage
(torch_backend.parallelize.tied): `uncounted`, clipped like the rest but left out of the norm,
which the first stage's embedding counts.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from torch_backend.dist import is_dtensor


def _groups(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            continue
        key = (p.grad.device_mesh, p.grad.placements) if is_dtensor(p.grad) else p.grad.device
        groups.setdefault(key, []).append(p)
    return list(groups.values())


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group=None,
                   uncounted: tuple[nn.Parameter, ...] = ()) -> torch.Tensor:
    """Total 2-norm of all gradients (before clipping); scales them to max_norm if above (0 = off)."""
    groups = _groups(params)
    skip = {id(p) for p in uncounted}
    total = torch.zeros((), dtype=torch.float32, device=groups[0][0].grad.device if groups else "cpu")
    for group in _groups(p for p in params if id(p) not in skip):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        total += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
