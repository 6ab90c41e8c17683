"""The MoE part of the MindFormers oracle (tests/mindspore/test_ms_oracle.py): MindFormers 2.1's LLaMA with a
moe_config (MoEV2: TopkRouterV2 + LlamaFeedForward with expert_num, the experts' BatchMatMuls on
(dp_moe, E, capacity, H)) against ms_llm's MoE layer (ms_llm/mindspore/moe.py, lower_moe.py).

Where the layers differ in structure, and so are not compared one to one:
- Dispatch. MindFormers gathers each expert's capacity of token slots per data-parallel group
  ((dp, E, capacity) dispatch indices, then a chain of reshapes, transposes and strided slices
  that MindSpore turns into the all-to-all over ep) and gathers them back for the combine. Ours
  runs each rank's E/ep experts over every token of its edp group (its use_allgather_dispatcher)
  and weights them with a dense (tokens, E) combine matrix; the sum over experts is an all-reduce
  over ep. No primitive of either dispatch has a counterpart in the other.
- Capacity. MindFormers counts each expert's queue per data-parallel group (CumSum split (dp, 1, 1));
  ours counts it over the whole batch in token order (the single-device result, as the torch
  backend), so our CumSum keeps the tokens whole.
- Router-loss arithmetic. MindFormers' z-loss takes logsumexp without subtracting the maximum and
  its load-balancing loss is per group; ours is the torch backend's (stable logsumexp, global f_e).
What is compared: the router MatMul, softmax, top-k, renormalisation, one-hot, the z-loss
primitives both have, and every expert primitive (three BatchMatMuls, SiLU, the up * gate Mul),
weights included, with E over ep, tokens over edp (dp_moe) and the expert width over tp.
"""
from __future__ import annotations

import fnmatch

# MindFormers r1.x MoEConfig kwargs (MoEV2 accepts only TopkRouterV2); ms_llm's converter reads them.
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "TopkRouterV2", "capacity_factor": 1.5,
       "aux_loss_factor": 0.01, "z_loss_factor": 0.001}
CASES = {
    "dp4_mp2_ep2_moe": ({"data_parallel": 4, "model_parallel": 2, "expert_parallel": 2, "vocab_emb_dp": False},
                        {"fused_rms_norm": False, "moe_config": MOE}),
    "dp4_mp2_ep4_moe": ({"data_parallel": 4, "model_parallel": 2, "expert_parallel": 4, "vocab_emb_dp": False},
                        {"moe_config": MOE}),
}

# MindFormers primitives of an MoE decoder layer with no counterpart of ours (the docstring's why).
NOT_OURS = {
    "feed_forward.transpose_*": "dispatch: the all-to-all over ep written as reshape + transpose",
    "feed_forward.stride_slice*": "dispatch: the all-to-all over ep written as strided slices",
    "feed_forward.concat_dp": "dispatch: comp_comm_parallel's interleaved concat",
    "feed_forward.ffn.w13_concat": "use_fused_swiglu's concatenated w1/w3 outputs, not built by either",
    "feed_forward.router.mul": "Router's multiplicative jitter (noisy_policy), off in training",
    "feed_forward.router.router.z_loss_func.mul": "scalar coefficient",
    "feed_forward.router.router.*": "capacity bookkeeping per data-parallel group and the dispatch / combine "
                                    "gathers; ours is a dense combine matrix with capacity over the batch",
}


def _mf_tokens(mine, theirs):
    """MindFormers' (dp, N/dp, ...) router tensors as ours, (N, ...)."""
    n = len(theirs.splits)
    return mine, theirs.merge(((0, 1),) + tuple((d,) for d in range(2, n)))


def _experts(mine, theirs):
    """Our (E, N, X) expert tensors as MindFormers' (dp_moe, E, ...): tokens first; its 4-d
    (dp_moe, E, capacity, X) merged to (dp_moe, E, capacity * X)."""
    if len(theirs.splits) == 4:
        theirs = theirs.merge(((0,), (1,), (2, 3)))
    return mine.permute((1, 0, 2)), theirs


VIEWS = {"mf_tokens": _mf_tokens, "experts": _experts}


def tokens(n: int) -> tuple:
    return ("mf_tokens",) * n


def pairs(pair, same, o: str, m: str) -> list:
    """Our MoE layer `o` (…mlp.) against MindFormers' `m` (…feed_forward.); `pair`/`same` are the
    oracle test's Pair and _same."""
    r, z, f = m + "router.router.", m + "router.router.z_loss_func.", m + "ffn."
    out = [same(o + "gate.matmul", m + "router.dense.matmul", 2),
           same(o + "softmax", r + "gating_activation", 1, views=tokens(1)),
           same(o + "topk", r + "topk", 1, views=tokens(1)),
           same(o + "sum_top", r + "reduce_sum_keep", 1, views=tokens(1)),
           same(o + "div", r + "div_3d", 2, views=tokens(2)),
           same(o + "one_hot", r + "onehot_2d", 3),
           same(o + "router_losses.exp", z + "exp", 1, views=tokens(1)),
           same(o + "router_losses.sum", z + "sum_ops", 1, views=tokens(1)),
           same(o + "router_losses.log", z + "ln", 1, views=tokens(1)),
           same(o + "router_losses.square", z + "square", 1, views=tokens(1)),
           same(o + "router_losses.mean", z + "mean_ops", 1, views=tokens(1)),
           # x (dp_moe, E, c, H) x w (E, F, H)^T: w's dims follow x's E, the matrix's extra mp axis, x's H
           same(o + "experts.bmm_gate", f + "w1.matmul", 2, views=("experts", None), align=(None, (1, 4, 3))),
           same(o + "experts.bmm_up", f + "w3.matmul", 2, views=("experts", None), align=(None, (1, 4, 3))),
           same(o + "experts.bmm_down", f + "w2.matmul", 2, views=("experts", None), align=(None, (1, None, 3))),
           # silu: ours sigmoid + mul, MindFormers' SiLU on w1's output
           pair(o + "experts.sigmoid", f + "w1.activation.silu", ((o + "experts.sigmoid", 0),), ("experts",)),
           pair(o + "experts.silu_mul", f + "w1.activation.silu", ((o + "experts.silu_mul", 0),), ("experts",)),
           same(o + "experts.mul", f + "mul", 2, views=("experts", "experts"))]
    return out


def explained(short: str) -> bool:
    return any(fnmatch.fnmatchcase(short, g) for g in NOT_OURS)
