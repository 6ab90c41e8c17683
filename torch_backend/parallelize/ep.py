"""Expert parallelism: each MoE layer keeps its share of the routed experts and learns its groups.

The plan splits the stacked expert weights (E, F, H) over ep on dim 0 and their width over etp,
on the expert mesh (edp, ep, etp) that folds the same ranks as the dense (dp, cp, tp)
(ms_llm.strategy.plan, kinds expert_column / expert_row). Here, on the meta device before
materialization, each expert weight is replaced by one of its local shape (materialize then
fills it with the plan's slice of the full tensor), and the MoE module is given its groups by
name: `ep` (its rows are exchanged over it), the dense `tp` (its rows are whole over it) and,
when etp is not tp, `etp` (the ranks holding the other slices of its experts' width). Experts are
plain tensors, not DTensors: the MoE layer does its own communication (torch_backend.moe_dispatch)
around its grouped matmuls. Their data parallelism is the shared ZeRO engine's: it partitions them
over edp, the ranks holding the same expert shard, beside the dense parameters (ms_llm.zero.partition).
"""
from __future__ import annotations

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
        module.tp_group = meshes.group("tp") if s.tp > 1 else None
        # etp = tp: the expert mesh's etp groups are the tp groups, over which the layer sums its slices
        module.tp_shares = s.tp > 1 and s.etp != s.tp
        module.etp_group = meshes.expert_group("etp") if s.etp > 1 and s.etp != s.tp else None
