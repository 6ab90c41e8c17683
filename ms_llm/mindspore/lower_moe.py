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
(ep, 1, mp)) and its router's token-parallel (dp*cp, 1) ops: tests/test_ms_oracle.py compares them
and says where the layers differ in structure.
"""
from __future__ import annotations

from functools import partial

from ms_llm.strategy.layout import TensorLayout
from ms_llm.strategy.plan import ModelPlan


def _tokens(flat: TensorLayout, *trailing: int) -> TensorLayout:
    """(N, *trailing) split over the token dim as `flat` (N, H) is: a per-token router tensor."""
    return TensorLayout((flat.shape[0], *trailing), flat.mesh, flat.placements, flat.order)


def moe_ops(plan: ModelPlan, layer: int) -> list:
    """Every primitive of layer `layer`'s MoE feed-forward, with its strategy."""
    from ms_llm.mindspore.lower import _flat, _op      # lower.py calls this module per MoE layer

    m, a, params = plan.model, plan.activations, plan.params
    p = f"model.layers.{layer}.mlp."
    e, k, h, f = m.moe.num_experts, m.moe.top_k, m.hidden_size, m.expert_ffn_size
    flat = _flat(a["mlp_input"])                                   # (N, H): tokens over dp*cp
    n = flat.shape[0]
    tok = partial(_tokens, flat)
    whole = TensorLayout.replicated((e,), plan.stage_mesh)         # per-expert load statistics
    em = plan.expert_mesh.without("pp")
    x_e = TensorLayout.build((e, n, h), em, ep=0, edp=1)           # tiled tokens, then expert outputs
    h_e = TensorLayout.build((e, n, f), em, ep=0, edp=1, tp=2)     # expert SwiGLU hidden
    w = {proj: params[f"{p}experts.{proj}.weight"].layout for proj in ("gate_proj", "up_proj", "down_proj")}

    ops = [_op(p + "gate.matmul", [flat, params[p + "gate.weight"].layout]),
           _op(p + "softmax", [tok(e)]), _op(p + "topk", [tok(e)]),
           _op(p + "sum_top", [tok(k)]), _op(p + "div", [tok(k), tok(1)]),
           _op(p + "one_hot", [tok(k, e), None, None]),
           # capacity: queue positions run over the whole batch in token order
           _op(p + "cumsum", [TensorLayout.replicated((n * k, e), plan.stage_mesh)]),
           _op(p + "less_equal", [tok(k, e), None]), _op(p + "mul_kept", [tok(k, e), tok(k, e)]),
           _op(p + "mul_weights", [tok(k, e), tok(k, 1)]), _op(p + "sum_copies", [tok(k, e)]),
           _op(p + "transpose", [tok(e)]),
           _op(p + "tile", [x_e]),                                  # the tiled dim splits its multiples
           _op(p + "experts.bmm_gate", [x_e, w["gate_proj"]]), _op(p + "experts.bmm_up", [x_e, w["up_proj"]]),
           _op(p + "experts.sigmoid", [h_e]), _op(p + "experts.silu_mul", [h_e, h_e]),
           _op(p + "experts.mul", [h_e, h_e]),
           _op(p + "experts.bmm_down", [h_e, w["down_proj"]]),
           _op(p + "mul_combine", [x_e, TensorLayout.build((e, n, 1), em, ep=0, edp=1)]),
           _op(p + "sum_experts", [x_e])]
    r = p + "router_losses."
    ops += [_op(r + "sum_copies", [tok(k, e)]), _op(r + "mean_tokens", [tok(e)]),
            _op(r + "mul", [whole, whole]), _op(r + "sum_experts", [whole]),
            _op(r + "max", [tok(e)]), _op(r + "sub", [tok(e), tok(1)]), _op(r + "exp", [tok(e)]),
            _op(r + "sum", [tok(e)]), _op(r + "log", [tok()]), _op(r + "add", [tok(), tok()]),
            _op(r + "square", [tok()]), _op(r + "mean", [tok()])]
    if m.moe.shared_experts:      # a dense SwiGLU of its own width, laid out as the dense MLP
        s, mh = p + "shared_experts.", a["mlp_hidden"]
        hidden = TensorLayout(mh.shape[:-1] + (m.moe.shared_experts * f,), mh.mesh, mh.placements, mh.order)
        ops += [_op(f"{s}{proj}.matmul", [flat, params[f"{s}{proj}.weight"].layout])
                for proj in ("gate_proj", "up_proj")]
        ops += [_op(s + "sigmoid", [hidden]), _op(s + "silu_mul", [hidden, hidden]), _op(s + "mul", [hidden, hidden]),
                _op(s + "down_proj.matmul", [_flat(hidden), params[s + "down_proj.weight"].layout],
                    _flat(a["hidden"])),
                _op(p + "add", [a["hidden"], a["hidden"]])]
    return ops
