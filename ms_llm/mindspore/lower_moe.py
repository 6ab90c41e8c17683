"""Shard strategies of one MoE layer (ms_llm/mindspore/moe.py), read off the plan as lower.py
reads the dense layers'.

Two meshes, the same ranks: the router works on the tokens as the dense layers hold them
(split over dp and cp, whole over tp); the experts on the expert mesh (edp, ep, tp), where dp*cp
is regrouped as edp x ep with ep innermost (ms_llm/strategy/mesh.py). The tiled (E, N, H) expert
input splits E over ep and the tokens over edp: each rank runs its E/ep experts over the tokens of
its edp group (the all-gather dispatch over ep of MindFormers' use_allgather_dispatcher), the
expert weights are the plan's (E over ep, the experts' own tp on their width), and the sum over
experts is an all-reduce over ep. These equal MindFormers 2.1's expert BatchMatMuls for the same
moe_config and expert_parallel ((dp_moe, ep, 1, 1) x (ep, mp, 1), then (dp_moe, ep, 1, mp) x
(ep, 1, mp)) and its router's token-parallel (dp*cp, 1) ops: tests/mindspore/test_ms_oracle.py compares them
and says where the layers differ in structure.
"""
from __future__ import annotations

from functools import partial

from ms_llm.mindspore.op_strategy import flat_tokens, op_shard
from ms_llm.strategy.layout import TensorLayout
from ms_llm.strategy.plan import ModelPlan


def _tokens(flat: TensorLayout, *trailing: int) -> TensorLayout:
    """(N, *trailing) split over the token dim as `flat` (N, H) is: a per-token router tensor."""
    return TensorLayout((flat.shape[0], *trailing), flat.mesh, flat.placements, flat.order)


def moe_ops(plan: ModelPlan, layer: int) -> list:
    """Every primitive of layer `layer`'s MoE feed-forward, with its strategy."""

    m, a, params = plan.model, plan.activations, plan.params
    p = f"model.layers.{layer}.mlp."
    e, k, h, f = m.moe.num_experts, m.moe.top_k, m.hidden_size, m.expert_ffn_size
    flat = flat_tokens(a["mlp_input"])                                   # (N, H): tokens over dp*cp
    n = flat.shape[0]
    tok = partial(_tokens, flat)
    whole = TensorLayout.replicated((e,), plan.stage_mesh)         # per-expert load statistics
    em = plan.expert_mesh.without("pp")
    x_e = TensorLayout.build((e, n, h), em, ep=0, edp=1)           # tiled tokens, then expert outputs
    h_e = TensorLayout.build((e, n, f), em, ep=0, edp=1, tp=2)     # expert SwiGLU hidden
    w = {proj: params[f"{p}experts.{proj}.weight"].layout for proj in ("gate_proj", "up_proj", "down_proj")}

    ops = [op_shard(p + "gate.matmul", [flat, params[p + "gate.weight"].layout]),
           op_shard(p + "softmax", [tok(e)]), op_shard(p + "topk", [tok(e)]),
           op_shard(p + "sum_top", [tok(k)]), op_shard(p + "div", [tok(k), tok(1)]),
           op_shard(p + "one_hot", [tok(k, e), None, None]),
           # capacity: queue positions run over the whole batch in token order
           op_shard(p + "cumsum", [TensorLayout.replicated((n * k, e), plan.stage_mesh)]),
           op_shard(p + "less_equal", [tok(k, e), None]), op_shard(p + "mul_kept", [tok(k, e), tok(k, e)]),
           op_shard(p + "mul_weights", [tok(k, e), tok(k, 1)]), op_shard(p + "sum_copies", [tok(k, e)]),
           op_shard(p + "transpose", [tok(e)]),
           op_shard(p + "tile", [x_e]),                                  # the tiled dim splits its multiples
           op_shard(p + "experts.bmm_gate", [x_e, w["gate_proj"]]), op_shard(p + "experts.bmm_up", [x_e, w["up_proj"]]),
           op_shard(p + "experts.sigmoid", [h_e]), op_shard(p + "experts.silu_mul", [h_e, h_e]),
           op_shard(p + "experts.mul", [h_e, h_e]),
           op_shard(p + "experts.bmm_down", [h_e, w["down_proj"]]),
           op_shard(p + "mul_combine", [x_e, TensorLayout.build((e, n, 1), em, ep=0, edp=1)]),
           op_shard(p + "sum_experts", [x_e])]
    r = p + "router_losses."
    ops += [op_shard(r + "sum_copies", [tok(k, e)]), op_shard(r + "mean_tokens", [tok(e)]),
            op_shard(r + "mul", [whole, whole]), op_shard(r + "sum_experts", [whole]),
            op_shard(r + "max", [tok(e)]), op_shard(r + "sub", [tok(e), tok(1)]), op_shard(r + "exp", [tok(e)]),
            op_shard(r + "sum", [tok(e)]), op_shard(r + "log", [tok()]), op_shard(r + "add", [tok(), tok()]),
            op_shard(r + "square", [tok()]), op_shard(r + "mean", [tok()])]
    if m.moe.shared_experts:      # a dense SwiGLU of its own width, laid out as the dense MLP
        s, mh = p + "shared_experts.", a["mlp_hidden"]
        hidden = TensorLayout(mh.shape[:-1] + (m.moe.shared_experts * f,), mh.mesh, mh.placements, mh.order)
        ops += [op_shard(f"{s}{proj}.matmul", [flat, params[f"{s}{proj}.weight"].layout])
                for proj in ("gate_proj", "up_proj")]
        ops += [op_shard(s + "sigmoid", [hidden]), op_shard(s + "silu_mul", [hidden, hidden]), op_shard(s + "mul", [hidden, hidden]),
                op_shard(s + "down_proj.matmul", [flat_tokens(hidden), params[s + "down_proj.weight"].layout],
                    flat_tokens(a["hidden"])),
                op_shard(p + "add", [a["hidden"], a["hidden"]])]
    return ops
