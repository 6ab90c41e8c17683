"""Expert parallelism: each MoE layer keeps its share of the routed experts and learns its groups.

The plan splits the stacked expert weights (E, F, H) over ep on dim 0 and their width over etp,
on the expert mesh (edp, ep, etp) that folds the same ranks as the dense (dp, cp, tp)
(ms_llm.strategy.plan, kinds expert_column / expert_row). Here, on the meta device before
materialization, each expert weight is replaced by one of its local shape (materialize then
fills it with the plan's slice of the full tensor), and the MoE module is given its groups by
name: `ep` (its rows are exchanged over it), the dense `tp` (its rows are whole over it) and,
when etp is not tp, `etp` (the ranks holding the other slices of its experts' width). Experts are
plain tensors, not DTensors: the MoE layer does its own communication (torch_backend.moe_dispatch)
around its grouped matmuls.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ms_llm.strategy.plan import ModelPlan
from ms_llm.zero.partition import zero_dim
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
        module.tp_group = meshes.group("tp") if s.tp > 1 else None
        # etp = tp: the expert mesh's etp groups are the tp groups, over which the layer sums its slices
        module.tp_shares = s.tp > 1 and s.etp != s.tp
        module.etp_group = meshes.expert_group("etp") if s.etp > 1 and s.etp != s.tp else None


class ExpertGrads:
    """Gradients and updates of the routed experts beside the shared ZeRO engine, which partitions
    only the dense parameters (ms_llm.zero.partition). A rank's expert gradient already sums its
    ep x etp block's tokens (the all-to-all and etp-gather backward bring them; each token copy is
    run by one such block); summing over the expert-data-parallel group (edp: the ranks holding the
    same expert shard) and dividing by dp*cp makes it the mean over the global batch, as the engine's
    dense gradients are. The experts join the global norm,
    and take the clip coefficient the engine applies.

    With zero.stage >= 1 the optimizer is ZeRO-1 over edp: each edp rank updates the slice of
    every expert weight the plan's optimizer_layout gives it (ms_llm.strategy.plan._expert_zero),
    holding 1/edp of the optimizer states, and all-gathers the updated slices. The weight stays
    the source of truth: a slice is copied from it before each update (so a checkpoint load of
    the weights needs nothing else). A rank without experts (its pipeline stage has no MoE layer)
    holds none and no optimizer, but joins the norm."""

    def __init__(self, params: dict[str, nn.Parameter], plan: ModelPlan, meshes: Meshes):
        s = plan.strategy
        self.params, self.replicas = params, s.edp
        self.edp = meshes.expert_group("edp") if self.replicas > 1 else None
        self.mean = 1.0 / (s.dp * s.cp)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.index = plan.expert_mesh.coords(dist.get_rank())["edp"]
        # name -> (dim the edp ranks split, this rank's slice as the optimizer's parameter)
        self.shards: dict[str, tuple[int, nn.Parameter]] = {}
        for name, p in params.items():
            entry = plan.params[name]
            dim = zero_dim(entry.layout, entry.zero_layout, ("edp",))
            if dim is not None:
                self.shards[name] = dim, nn.Parameter(p.detach().chunk(self.replicas, dim)[self.index].clone())

    def state_params(self) -> dict[str, nn.Parameter]:
        """Checkpoint name -> the tensor the optimizer keeps states for (a slice under ZeRO-1)."""
        return {n: self.shards[n][1] if n in self.shards else p for n, p in self.params.items()}

    def make_optimizer(self, cls: type, kwargs: dict) -> None:
        if self.params:
            self.optimizer = cls(list(self.state_params().values()), **kwargs)

    @torch.no_grad()
    def reduce(self) -> float:
        """Reduce the expert gradients; returns their squared global norm (a world collective)."""
        sq = torch.zeros((), dtype=torch.float32)
        for p in self.params.values():
            if self.edp is not None:
                dist.all_reduce(p.grad, group=self.edp)     # gloo has no reduce-scatter: ZeRO-1 slices below
            p.grad.mul_(self.mean)
            sq += p.grad.float().square().sum()
        dist.all_reduce(sq)                         # every expert element once per edp replica
        return sq.item() / self.replicas

    @torch.no_grad()
    def step(self, lr: float, norm: Optional[float], grad_clip: float, loss_scale: Optional[float]) -> None:
        """The engine's update rule: skip on a non-finite norm, else clip by the global norm and step."""
        if self.optimizer is None:
            return
        if norm is not None and not math.isfinite(norm):
            self._drop_grads()
            return
        coef = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
        coef /= loss_scale or 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for name, p in self.params.items():
            if name in self.shards:
                dim, shard = self.shards[name]
                shard.copy_(p.chunk(self.replicas, dim)[self.index])
                shard.grad = p.grad.chunk(self.replicas, dim)[self.index].mul(coef)
            else:
                p.grad.mul_(coef)
        self.optimizer.step()
        self._drop_grads()
        for name, (dim, shard) in self.shards.items():
            pieces = [torch.empty_like(shard) for _ in range(self.replicas)]
            dist.all_gather(pieces, shard, group=self.edp)
            self.params[name].copy_(torch.cat(pieces, dim))

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = None


def expert_params(parts: list[nn.Module], plan: ModelPlan) -> dict[str, nn.Parameter]:
    return {name: p for part in parts for name, p in part.named_parameters()
            if plan.params[name].kind in ("expert_column", "expert_row")}
