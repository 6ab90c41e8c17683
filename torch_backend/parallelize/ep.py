"""Expert parallelism: each MoE layer keeps its share of the routed experts and learns its groups.

The plan splits the stacked expert weights (E, F, H) over ep on dim 0 and, under tensor
parallelism, the expert width over tp (ms_llm.strategy.plan, kinds expert_column / expert_row).
Here, on the meta device before materialization, each expert weight is replaced by one of
its local shape (materialize then fills it with the plan's slice of the full tensor), and the
MoE module is given the `ep` group its tokens are exchanged over and the `tp` group its
partial outputs are summed over. Experts are plain tensors, not DTensors: the MoE layer does
its own communication (all-to-all dispatch, tp all-reduce) around per-expert matmuls.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ms_llm.strategy.plan import ModelPlan
from torch_backend.mesh import Meshes
from torch_backend.moe import MoE


def apply_ep(part: nn.Module, plan: ModelPlan, meshes: Meshes) -> None:
    """Shrink this part's expert weights to their local shape and attach the groups."""
    s = plan.strategy
    for name, module in part.named_modules():
        if not isinstance(module, MoE):
            continue
        for pname, stacked in module.experts.named_children():
            layout = plan.params[f"{name}.experts.{pname}.weight"].layout
            stacked.weight = nn.Parameter(stacked.weight.new_empty(layout.local_shape()))
        module.ep_group = meshes.expert_group("ep") if s.ep > 1 else None
        module.tp_group = meshes.expert_group("tp") if s.tp > 1 else None


class ExpertGrads:
    """Gradients and updates of the routed experts beside the shared ZeRO engine, which partitions
    only the dense parameters (ms_llm.zero.partition). A rank's expert gradient already sums its
    ep group's tokens (the all-to-all backward brings them); summing over the expert-data-parallel
    group (edp: the ranks holding the same experts) and dividing by dp*cp makes it the mean over
    the global batch, as the engine's dense gradients are. The experts join the global norm,
    and take the clip coefficient the engine applies."""

    def __init__(self, params: list[nn.Parameter], plan: ModelPlan, meshes: Meshes):
        s = plan.strategy
        self.params, self.replicas = params, s.dp * s.cp // s.ep
        self.edp = meshes.expert_group("edp") if self.replicas > 1 else None
        self.mean = 1.0 / (s.dp * s.cp)
        self.optimizer: Optional[torch.optim.Optimizer] = None

    def make_optimizer(self, cls: type, kwargs: dict) -> None:
        self.optimizer = cls(self.params, **kwargs)

    @torch.no_grad()
    def reduce(self) -> float:
        """Reduce the expert gradients; returns their squared global norm (a world collective)."""
        sq = torch.zeros((), dtype=torch.float32)
        for p in self.params:
            if self.edp is not None:
                dist.all_reduce(p.grad, group=self.edp)
            p.grad.mul_(self.mean)
            sq += p.grad.float().square().sum()
        dist.all_reduce(sq)                         # every expert element once per edp replica
        return sq.item() / self.replicas

    @torch.no_grad()
    def step(self, lr: float, norm: Optional[float], grad_clip: float, loss_scale: Optional[float]) -> None:
        """The engine's update rule: skip on a non-finite norm, else clip by the global norm and step."""
        if norm is not None and not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return
        coef = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
        coef /= loss_scale or 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p in self.params:
            p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def expert_params(parts: list[nn.Module], plan: ModelPlan) -> list[nn.Parameter]:
    return [p for part in parts for name, p in part.named_parameters()
            if plan.params[name].kind in ("expert_column", "expert_row")]
