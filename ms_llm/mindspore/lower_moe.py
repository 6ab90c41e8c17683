"""Shard strategies of one MoE layer (ms_llm/mindspore/moe.py), read off the plan as lower.py
reads the dense layers', and the layer's capacity and token groups (framework-free, so moe.py and
the lowering share them).

Two meshes, the same ranks (ms_llm/strategy/mesh.py): the dense (dp, cp, tp) and the experts'
(edp, ep, etp), etp innermost, which folds them (Megatron-core's MoE parallel folding). The router
works on the tokens as the residual stream holds them (split over dp and cp, and over tp too under
sequence parallel, where Megatron-core and MindFormers route each rank's own sequence chunk; whole
over tp otherwise), or, when etp < tp without sequence parallel, split like the token groups, as
MindFormers' MoEV2 routes with expert_model_parallel 1 (its router's dp becomes dp*cp*mp). The
dispatch works on the token groups, one per edp x ep position (token_groups: dp*cp of them when
etp = tp). Capacity, dispatch and combine are token-parallel over the groups ((edp*ep, ...), as
MindFormers' TopkRouterV2 splits its (dp, ...) tensors), each group's tokens whole over etp. The
experts run on (E, groups * C, H) with E over ep and the groups over edp, their weights as the plan
lays them out (E over ep, the width over etp), the SwiGLU hidden's width over etp. Between the two layouts sit
the all-to-alls over ep of MindFormers' MoEV2 (with enable_alltoall): into transpose_in, whose input
(groups, E, C, H) takes E over ep and the groups over edp, as MindFormers' transpose_5dim_ep2 takes
its (dp_moe, ep, E, n, h) dispatch; and into transpose_out, whose input (E, groups, C, H) takes the
groups over edp x ep again, as transpose_5dim_ep2 takes its combine. tests/mindspore/test_ms_oracle.py
compares these with MindFormers 2.1's MoE (router, capacity CumSum, dispatch and combine gathers,
both all-to-all transposes, expert BatchMatMuls) and says where the layers differ. DeepSeek's routing
(sigmoid scores renormalised for the losses, the expert bias replicated on every rank of the stage
beside token-split scores, group-limited top-k, the scores gathered at the choice,
routed_scaling_factor, the sequence-wise loss per sequence split like the tokens) is token-parallel the
same way, as MindFormers 2.1's DeepSeek-V3 TopKRouter; the expert loads are summed over the tokens, so
every rank holds the same loads and moves its biases alike.

With moe.use_gmm (dropless by sorting, moe.py) the sort, the gathers and the combine are
token-parallel over the groups as MoEV3 shards them ((dp*mp, 1, ...); not yet compared with it in
test_ms_oracle.py). Its expert stage, a Morph whose AlltoAllV over ep moves each
rank's sorted copies to their experts' ranks, is not lowered: support.py runs use_gmm on one device.
"""
from __future__ import annotations

import math
from functools import partial

from ms_llm.config.model import MoEConfig
from ms_llm.mindspore.op_strategy import OpShard, flat_tokens, op_shard, reshaped, select
from ms_llm.strategy.layout import TensorLayout
from ms_llm.strategy.plan import ModelPlan


def expert_capacity(moe: MoEConfig, tokens: int) -> int:
    """Slots per expert in a group of `tokens` tokens: ceil(capacity_factor x tokens x top_k / E)
    (GShard, the torch backend's), at most `tokens` (an expert gets one copy of a token at most, so
    more slots would stay empty); dropless (-1) is `tokens`, the worst case."""
    if moe.capacity_factor < 0:
        return tokens
    return min(math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.num_experts), tokens)


def token_groups(plan: ModelPlan) -> int:
    """Capacity groups under semi_auto_parallel: one per edp x ep position of the expert mesh (one per
    data-parallel x context-parallel rank when etp = tp, more when ep folds over tp too)."""
    em = plan.expert_mesh
    return em.axis_size("edp") * em.axis_size("ep")


def _tokens(flat: TensorLayout, *trailing: int) -> TensorLayout:
    """(N, *trailing) split over the token dim as `flat` (N, H) is: a per-token router tensor."""
    return reshaped(flat, (flat.shape[0], *trailing))


def _deepseek_ops(plan: ModelPlan, p: str, tok, whole: TensorLayout) -> list[OpShard]:
    """The routing primitives DeepSeek's fields add (model.moe): sigmoid scores and their renormalised
    copy, the expert bias (whole) on the scores, group-limited top-k, the scores at the choice, the
    scaling, the loads and the sequence-wise balance loss."""
    moe, hidden = plan.model.moe, plan.activations["hidden"]
    e, k, g = moe.num_experts, moe.top_k, moe.num_groups
    ops = []
    if moe.score_function == "sigmoid":
        ops += [op_shard(p + "sigmoid", [tok(e)]), op_shard(p + "sum_scores", [tok(e)]),
                op_shard(p + "div_scores", [tok(e), tok(1)])]
    if moe.expert_bias:
        ops += [op_shard(p + "add_bias", [tok(e), whole]), op_shard(p + "sum_load", [tok(k, e)])]
    if g > 1:
        keep, lg = moe.group_top_k, p + "limit_groups."
        ops += [op_shard(lg + "topk", [tok(g, e // g)]), op_shard(lg + "sum", [tok(g, k // keep)]),
                op_shard(lg + "topk_groups", [tok(g)]), op_shard(lg + "one_hot", [tok(keep, g), None, None]),
                op_shard(lg + "sum_kept", [tok(keep, g)]), op_shard(lg + "tile", [tok(g, e // g)]),
                op_shard(lg + "greater", [tok(e), None]), op_shard(lg + "select", [tok(e), tok(e), tok(e)])]
    if moe.expert_bias or g > 1:
        ops.append(op_shard(p + "gather", [tok(e), None, tok(k)]))
    if moe.routed_scaling_factor != 1.0:
        ops.append(op_shard(p + "mul_scaling", [tok(k), None]))
    if moe.seq_aux_loss_coeff > 0:      # per sequence: (B, T, ...) split as the residual stream's (B, T)
        b, t, _ = hidden.shape
        seq, sa = reshaped(hidden, (b, t, e)), p + "seq_aux_loss."
        per_seq = select(seq, (0, 2))                                    # (B, E)
        ops += [op_shard(sa + "sum_copies", [reshaped(hidden, (b, t, k, e))]), op_shard(sa + "sum_tokens", [seq]),
                op_shard(sa + "mean_tokens", [seq]), op_shard(sa + "mul", [per_seq, per_seq]),
                op_shard(sa + "sum_experts", [per_seq]), op_shard(sa + "mean", [select(seq, (0,))])]
    return ops


def moe_ops(plan: ModelPlan, layer: str) -> list[OpShard]:
    """Every primitive of the MoE feed-forward of decoder layer `layer` (model.layers.N. or
    model.mtp.D.layer.), with its strategy."""

    m, a, params = plan.model, plan.activations, plan.params
    p = layer + "mlp."
    e, k, h, f = m.moe.num_experts, m.moe.top_k, m.hidden_size, m.expert_ffn_size
    s = plan.strategy
    flat = flat_tokens(a["hidden"])                                      # (N, H): the residual stream's tokens
    em = plan.expert_mesh.without("pp")
    if s.etp < s.tp and not s.sequence_parallel:                         # routed where the token groups are
        flat = TensorLayout.build(flat.shape, em, edp=0, ep=0)
    tok = partial(_tokens, flat)
    whole = TensorLayout.replicated((e,), plan.stage_mesh)         # per-expert load statistics, the expert bias
    g = token_groups(plan)
    n = flat.shape[0] // g                                               # tokens per group
    c = expert_capacity(m.moe, n)

    def grouped(*shape: int) -> TensorLayout:                           # (G, ...): one group per edp x ep position
        return TensorLayout.build((g, *shape), em, edp=0, ep=0)

    w = {proj: params[f"{p}experts.{proj}.weight"].layout for proj in ("gate_proj", "up_proj", "down_proj")}
    ops = [op_shard(p + "gate.matmul", [flat, params[p + "gate.weight"].layout]),
           op_shard(p + "softmax", [tok(e)]), op_shard(p + "topk", [tok(e)]),
           op_shard(p + "sum_top", [tok(k)]), op_shard(p + "div", [tok(k), tok(1)]),
           op_shard(p + "one_hot", [tok(k, e), None, None])]
    ops += _sorted_ops(p, grouped, n, k, e, h) if m.moe.use_gmm else _capacity_ops(p, grouped, em, n, k, e, h, f, c, w)
    r = p + "router_losses."
    ops += [op_shard(r + "sum_copies", [tok(k, e)]), op_shard(r + "mean_tokens", [tok(e)]),
            op_shard(r + "mul", [whole, whole]), op_shard(r + "sum_experts", [whole]),
            op_shard(r + "max", [tok(e)]), op_shard(r + "sub", [tok(e), tok(1)]), op_shard(r + "exp", [tok(e)]),
            op_shard(r + "sum", [tok(e)]), op_shard(r + "log", [tok()]), op_shard(r + "add", [tok(), tok()]),
            op_shard(r + "square", [tok()]), op_shard(r + "mean", [tok()])]
    ops += _deepseek_ops(plan, p, tok, whole)
    if m.moe.shared_experts:      # a dense SwiGLU of its own width, laid out as the dense MLP
        s, mh = p + "shared_experts.", a["mlp_hidden"]
        hidden = TensorLayout(mh.shape[:-1] + (m.moe.shared_experts * f,), mh.mesh, mh.placements, mh.order)
        ops += [op_shard(f"{s}{proj}.matmul", [flat_tokens(a["mlp_input"]), params[f"{s}{proj}.weight"].layout])
                for proj in ("gate_proj", "up_proj")]
        ops += [op_shard(s + "sigmoid", [hidden]), op_shard(s + "silu_mul", [hidden, hidden]), op_shard(s + "mul", [hidden, hidden]),
                op_shard(s + "down_proj.matmul", [flat_tokens(hidden), params[s + "down_proj.weight"].layout],
                    flat_tokens(a["hidden"])),
                op_shard(p + "add", [a["hidden"], a["hidden"]])]
    return ops


def _sorted_ops(p: str, grouped, n: int, k: int, e: int, h: int) -> list[OpShard]:
    """use_gmm's sort, dispatch and combine, per token group (MoEV3's _tensor_sort / _tensor_unsort)."""
    return [op_shard(p + "transpose_ids", [grouped(n, k)]), op_shard(p + "sort", [grouped(k * n)]),
            op_shard(p + "mod", [grouped(k * n), None]),
            op_shard(p + "gather_sort", [grouped(n, h), grouped(k * n)]),
            op_shard(p + "sum_counts", [grouped(n * k, e)]), op_shard(p + "sort_back", [grouped(k * n)]),
            op_shard(p + "transpose_unsort", [grouped(k, n)]),
            op_shard(p + "gather_unsort", [grouped(k * n, h), grouped(n, k)]),
            op_shard(p + "mul_combine", [grouped(n, k, h), grouped(n, k, 1)]),
            op_shard(p + "sum_copies", [grouped(n, k, h)])]


def _capacity_ops(p: str, grouped, em, n: int, k: int, e: int, h: int, f: int, c: int,
                  w: dict[str, TensorLayout]) -> list[OpShard]:
    """Capacity dispatch, the experts' BatchMatMuls and combine, per token group."""
    g = grouped().shape[0]
    copies = grouped(n * k, e)
    rows = TensorLayout.build((e, g * c, h), em, ep=0, edp=1)           # expert rows: E over ep, groups over edp
    hidden = TensorLayout.build((e, g * c, f), em, ep=0, edp=1, etp=2)  # expert SwiGLU hidden, its width over etp
    return [
           # capacity, per group: queue places in token order, the kept copies, their slots
           op_shard(p + "cumsum", [copies]), op_shard(p + "less_equal", [copies, None]),
           op_shard(p + "mul_kept", [copies, copies]), op_shard(p + "sub_priority", [None, copies]),
           op_shard(p + "mul_priority", [copies, copies]), op_shard(p + "sum_choices", [grouped(n, k, e)]),
           op_shard(p + "transpose_kept", [grouped(n, e)]), op_shard(p + "topk_slots", [grouped(e, n)]),
           op_shard(p + "mul_offsets", [TensorLayout.replicated((e,), em), None]),
           op_shard(p + "add_slots", [copies, TensorLayout.replicated((e,), em)]),
           op_shard(p + "mul_slots", [copies, copies]), op_shard(p + "sum_slots", [copies]),
           op_shard(p + "sum_kept", [copies]), op_shard(p + "mul_weights", [grouped(n * k), grouped(n * k)]),
           # dispatch into (G, E, C, H); the all-to-all over ep into each transpose
           op_shard(p + "dispatch", [grouped(n, h), grouped(e, c)]),
           op_shard(p + "transpose_in", [TensorLayout.build((g, e, c, h), em, edp=0, ep=1)]),
           op_shard(p + "experts.bmm_gate", [rows, w["gate_proj"]]), op_shard(p + "experts.bmm_up", [rows, w["up_proj"]]),
           op_shard(p + "experts.sigmoid", [hidden]), op_shard(p + "experts.silu_mul", [hidden, hidden]),
           op_shard(p + "experts.mul", [hidden, hidden]),
           op_shard(p + "experts.bmm_down", [hidden, w["down_proj"]]),
           op_shard(p + "transpose_out", [TensorLayout.build((e, g, c, h), em, edp=1, ep=1)]),
           # combine: each kept copy's slot, weighted, summed over the token's copies
           op_shard(p + "combine", [grouped(e * c, h), grouped(n * k)]),
           op_shard(p + "mul_combine", [grouped(n * k, h), grouped(n * k, 1)]),
           op_shard(p + "sum_copies", [grouped(n, k, h)])]
