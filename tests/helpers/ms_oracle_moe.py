"""The MoE part of the MindFormers oracle (tests/mindspore/test_ms_oracle.py): MindFormers 2.1's LLaMA with a
moe_config (MoEV2: TopkRouterV2 + LlamaFeedForward with expert_num, capacity dispatch with static shapes,
the experts' BatchMatMuls on (dp_moe, E, ep * capacity, H)) against ms_llm's MoE layer
(ms_llm/mindspore/moe.py, lower_moe.py), at ep2, ep4 and ep8 with mp2 and dp, and with expert parallel
folding: moe_config.expert_model_parallel 1 (whole experts, MoEV2's mp_moe, our etp 1) with ep4 over
dp2 x mp2, where MoEV2 routes and dispatches over dp*mp token groups and so do we (lower_moe.py).

Both dispatch by capacity per token group, one group per data-parallel rank: a CumSum over each
group's copies, a Gather of the tokens into (groups, E, C, H), the experts on E over ep and the groups
over dp / ep (dp_moe = edp), a Gather back by each copy's slot, weighted and summed over the copies.
The all-to-all over ep sits in the same place in both: between the dispatch Gather (groups over dp)
and the experts (E over ep), and between the experts and the combine Gather. MindSpore puts it into
the primitive whose input layout moves the ep split: MindFormers' transpose_5dim_ep2, called on the
dispatch ((dp_moe, ep, E, n, h), E over ep) and on the combine ((dp_moe, E, ep, n, h), the groups
over ep), ours transpose_in ((G, E, C, H), E over ep) and transpose_out ((E, G, C, H), G over
edp x ep). Both transposes are compared with it, each in its own view, so moving either all-to-all is
caught (test_the_moe_all_to_all_placement_can_fail).

Compared: the router MatMul, softmax, top-k, renormalisation, one-hot, the capacity CumSum and the
arithmetic on its (groups, copies, E) places, the slot pick (TopK against its Sort), the dispatch and
combine Gathers, the weighting and the sum over copies, both all-to-all transposes, the z-loss
primitives both have, and every expert primitive (three BatchMatMuls, SiLU, the up * gate Mul),
weights included, with E over ep, the groups over edp (dp_moe) and the expert width over tp.

Where the layers differ (NOT_OURS names each MindFormers primitive this leaves without a counterpart):
- Capacity priority. MindFormers' default (kdrop, enable_sdrop off) queues every token's first choice
  before any second choice; ours queues copies in token order (GShard's capacity as the torch backend
  drops, so both backends drop the same copies). Same layouts, other arithmetic.
- Capacity size. MindFormers rounds C up to a multiple of mp (its sequence-parallel and group-wise
  paths split C over mp); ours is ceil(capacity_factor x n x k / E) (at most n), whole over tp.
- Slot pick. MindFormers sorts per-expert keys built from a range constant and takes the token index
  mod n, plus 1 for a zero row it prepends; ours takes TopK(C) of the kept copies' queue priorities,
  whose indices are the token indices. Its zero row (dispatch) and zero slot per expert (combine) have no
  counterpart: an empty slot of ours computes on some token and is never read, a dropped copy's weight is 0.
- Expert rows. MindFormers' BatchMatMul broadcasts (dp_moe, E, ep * C, H) against (E, H, F), which only
  Ascend does; ours runs (E, groups * C, H) (MindSpore's CPU BatchMatMul does not broadcast), so ours
  transposes where MindFormers reshapes: transpose_in / transpose_out, the same all-to-all.
- Router-loss arithmetic. MindFormers' z-loss takes logsumexp without subtracting the maximum and
  its load-balancing loss is per group; ours is the torch backend's (stable logsumexp, global f_e).
"""
from __future__ import annotations

import fnmatch
import math

# MindFormers r1.x MoEConfig kwargs (MoEV2 accepts only TopkRouterV2); ms_llm's converter reads them.
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "TopkRouterV2", "capacity_factor": 1.5,
       "aux_loss_factor": 0.01, "z_loss_factor": 0.001}
CASES = {
    "dp4_mp2_ep2_moe": ({"data_parallel": 4, "model_parallel": 2, "expert_parallel": 2, "vocab_emb_dp": False},
                        {"fused_rms_norm": False, "moe_config": MOE}),
    "dp4_mp2_ep4_moe": ({"data_parallel": 4, "model_parallel": 2, "expert_parallel": 4, "vocab_emb_dp": False},
                        {"moe_config": MOE}),
    "dp8_mp2_ep8_moe": ({"data_parallel": 8, "model_parallel": 2, "expert_parallel": 8, "vocab_emb_dp": False},
                        {"moe_config": {**MOE, "expert_num": 8}}),
    # expert parallel folding: whole experts (expert_model_parallel 1), ep 4 over dp 2 x mp 2 (our etp 1)
    "dp2_mp2_ep4_etp1_moe": ({"data_parallel": 2, "model_parallel": 2, "expert_parallel": 4, "vocab_emb_dp": False},
                             {"moe_config": {**MOE, "expert_model_parallel": 1}}),
}

_NEVER_CALLED = "built but never called on MoEV2's path in these cases"
_GROUP_WISE = "group_wise_a2a (off): the all-to-all split over mp, then an all-gather; ours is the plain all-to-all"
_SLOT_KEYS = "slot pick: sort keys from a range constant; ours ranks the kept copies by their queue places"
_TOKEN_INDEX = "slot pick: sorted key -> token index + 1 (its zero row); ours are TopK's indices"
_COMBINE_INDEX = "combine index expert x (C + 1) + place over its zero-padded slots and the kept test on it; " \
                 "ours e x C + place - 1 on (groups, copies, E) (mul_offsets, add_slots, mul_slots) and sum_kept"
_BALANCE = "load-balancing loss per data-parallel group; ours over the whole batch (the torch backend's)"
# MindFormers primitives of an MoE decoder layer with no counterpart of ours (the docstring's why).
NOT_OURS = {
    "feed_forward.transpose_4dim_*": _NEVER_CALLED,
    "feed_forward.concat_dp": _NEVER_CALLED,
    "feed_forward.stride_slice": _NEVER_CALLED,
    "feed_forward.stride_slice_dp": _NEVER_CALLED,
    "feed_forward.stride_slice_ep": _NEVER_CALLED,
    "feed_forward.stride_slice_dp_mp": _NEVER_CALLED,
    "feed_forward.stride_slice_ep_mp": _NEVER_CALLED,
    "feed_forward.stride_slice_outer_*": _GROUP_WISE,
    "feed_forward.transpose_5dim_ep1": _GROUP_WISE,
    "feed_forward.transpose_mp*": "use_seq_parallel's expert path (_ffn_forward_sq), not in these cases",
    "feed_forward.stride_slice_allgather": "use_seq_parallel's expert path (_ffn_forward_sq), not in these cases",
    "feed_forward.ffn.w13_concat": "use_fused_swiglu's concatenated w1/w3 outputs, not built by either",
    "feed_forward.router.mul": "Router's multiplicative jitter (noisy_policy), off in training",
    "feed_forward.router.router.argmax": "top-1 routing; these cases route top-2 through topk, compared",
    "feed_forward.router.router.onehot_3d": _NEVER_CALLED,
    "feed_forward.router.router.mul_4d": _NEVER_CALLED,
    "feed_forward.router.router.bmm_range": _NEVER_CALLED,
    "feed_forward.router.router.transpose": _NEVER_CALLED,
    "feed_forward.router.router.not_equal": _NEVER_CALLED,
    "feed_forward.router.router.zeros_op": "dispatch: the zero row empty slots gather; ours leaves them unread",
    "feed_forward.router.router.concat_3d": "dispatch: the zero row empty slots gather; ours leaves them unread",
    "feed_forward.router.router.zeros_op_4d": "combine: a zero slot per expert for dropped copies; ours weighs them 0",
    "feed_forward.router.router.concat": "combine: a zero slot per expert for dropped copies; ours weighs them 0",
    "feed_forward.router.router.slice_range": _SLOT_KEYS,
    "feed_forward.router.router.add_range": _SLOT_KEYS,
    "feed_forward.router.router.mul_range": _SLOT_KEYS,
    "feed_forward.router.router.add_3d": _SLOT_KEYS,
    "feed_forward.router.router.slice": "slot pick: the first C sorted keys; ours TopK(C) returns them",
    "feed_forward.router.router.mod": _TOKEN_INDEX,
    "feed_forward.router.router.add_one": _TOKEN_INDEX,
    "feed_forward.router.router.mul_2d_1d": _COMBINE_INDEX,
    "feed_forward.router.router.add_2d": _COMBINE_INDEX,
    "feed_forward.router.router.gt": _COMBINE_INDEX,
    "feed_forward.router.router.reduce_mean": _BALANCE,
    "feed_forward.router.router.reduce_mean_2d": _BALANCE,
    "feed_forward.router.router.mul_2d": _BALANCE,
    "feed_forward.router.router.mul": _BALANCE,
    "feed_forward.router.router.add_eps": "the 1e-9 of its renormalisation; ours adds 1e-20 outside a primitive",
}


def _mf_tokens(mine, theirs):
    """MindFormers' (dp, N/dp, ...) router tensors as ours, (N, ...)."""
    n = len(theirs.splits)
    return mine, theirs.merge(((0, 1),) + tuple((d,) for d in range(2, n)))


def _mf_copies(mine, theirs):
    """MindFormers' (dp, n, k, ...) per-copy tensors as ours, (groups, n * k, ...)."""
    n = len(theirs.splits)
    return mine, theirs.merge(((0,), (1, 2)) + tuple((d,) for d in range(3, n)))


def _experts(mine, theirs):
    """Our (E, groups * C, X) expert tensors as MindFormers' (dp_moe, E, ...): rows first; its 4-d
    (dp_moe, E, ep * capacity, X) merged to (dp_moe, E, ep * capacity * X)."""
    if len(theirs.splits) == 4:
        theirs = theirs.merge(((0,), (1,), (2, 3)))
    return mine.permute((1, 0, 2)), theirs


def _a2a_dispatch(mine, theirs):
    """transpose_5dim_ep2 on the dispatch, (dp_moe, ep, E, n, h), as our transpose_in's (G, E, C, H)."""
    return mine, theirs.merge(((0, 1), (2,), (3,), (4,)))


def _a2a_combine(mine, theirs):
    """transpose_5dim_ep2 on the combine, (dp_moe, E, ep, n, h), as our transpose_out's (E, G, C, H)."""
    return mine, theirs.permute((1, 0, 2, 3, 4)).merge(((0,), (1, 2), (3,), (4,)))


VIEWS = {"mf_tokens": _mf_tokens, "mf_copies": _mf_copies, "experts": _experts, "a2a_dispatch": _a2a_dispatch,
         "a2a_combine": _a2a_combine}


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
           # capacity per group: (groups, copies, E) as its (dp, kN, E)
           same(o + "cumsum", r + "cumsum", 1),
           same(o + "less_equal", r + "less", 2),
           same(o + "mul_kept", r + "mul_3d", 2),
           same(o + "mul_priority", r + "mul_3d", 2),
           same(o + "mul_slots", r + "mul_3d", 2),
           same(o + "sub_priority", r + "sub_range", 2),
           same(o + "sum_slots", r + "reduce_sum", 1),
           same(o + "sum_kept", r + "reduce_sum", 1),
           same(o + "transpose_kept", r + "transpose_3d", 1),
           same(o + "topk_slots", r + "sort_range", 1),
           same(o + "mul_weights", r + "mul_3d", 2, views=("mf_copies", "mf_copies")),
           # dispatch, the all-to-all into the experts and back, combine
           same(o + "dispatch", r + "dispatch_gather", 2),
           pair(o + "transpose_in", m + "transpose_5dim_ep2", ((o + "transpose_in", 0),), ("a2a_dispatch",)),
           pair(o + "transpose_out", m + "transpose_5dim_ep2", ((o + "transpose_out", 0),), ("a2a_combine",)),
           same(o + "combine", r + "combine_gather", 2, views=(None, "mf_copies")),
           same(o + "mul_combine", r + "mul_router_coeff", 2, views=("mf_copies", "mf_copies")),
           same(o + "sum_copies", r + "sum_router_coeff", 1),
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


def explained(short: str) -> str | None:
    """The NOT_OURS entry that explains MindFormers primitive `short`, None if none does."""
    return next((g for g in NOT_OURS if fnmatch.fnmatchcase(short, g)), None)


# ---- ZeRO: MindSpore's parallel optimizer ------------------------------------------------------------
# MindFormers' MoE configs (configs/general/llm_pretrain_moe_template.yaml, the Qwen3-MoE and DeepSeek ones)
# turn the parallel optimizer on and leave optimizer_weight_shard_size at -1 and the threshold at 64 KB.
MF_SHARD_SIZE, MF_THRESHOLD_KB = -1, 64
# Our parameter name -> MindFormers' (LLaMA, with or without moe_config), part by part.
_NAMES = (("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
          ("self_attn.q_proj.", "attention.wq."), ("self_attn.k_proj.", "attention.wk."),
          ("self_attn.v_proj.", "attention.wv."), ("self_attn.o_proj.", "attention.wo."),
          ("input_layernorm.", "attention_norm."), ("post_attention_layernorm.", "ffn_norm."),
          ("mlp.gate.", "feed_forward.router.dense."), ("mlp.experts.gate_proj.", "feed_forward.ffn.w1."),
          ("mlp.experts.up_proj.", "feed_forward.ffn.w3."), ("mlp.experts.down_proj.", "feed_forward.ffn.w2."),
          ("mlp.gate_proj.", "feed_forward.w1."), ("mlp.up_proj.", "feed_forward.w3."),
          ("mlp.down_proj.", "feed_forward.w2."), ("model.norm.", "model.norm_out."))
# MindFormers parameters its own parallel optimizer leaves whole, and why. Ours are split (ms_llm's plan
# hands every weight to ZeRO, threshold 0); what MindSpore's rule makes of MindFormers' layout of them is
# compared all the same.
_KEPT_WHOLE = "MindFormers builds its LLaMA {} with parallel_optimizer=False, whole on every rank"
KEPT_WHOLE = {
    "model.tok_embeddings.embedding_weight": _KEPT_WHOLE.format("embedding"),
    "*norm*.weight": _KEPT_WHOLE.format("RMSNorm weights"),
    "*.feed_forward.router.dense.weight": "the router (E x hidden, 4 KB here) is under MindFormers' 64 KB threshold",
}


def mf_param(ours: str) -> str:
    """MindFormers' name of our parameter `ours`."""
    for a, b in _NAMES:
        ours = ours.replace(a, b)
    return ours


def kept_whole(mf: str) -> str | None:
    return next((why for g, why in KEPT_WHOLE.items() if fnmatch.fnmatchcase(mf, g)), None)


def mf_weight(records: dict, mf: str) -> tuple[str, list, list | None]:
    """The primitive MindFormers shards weight `mf` with, its strategy of the weight and of the input whose
    device matrix places it (None: its own): a Linear's MatMul / BatchMatMul input 1 (after input 0), the
    embedding's Gather input 0 (with the token indices), an RMSNorm's gamma (RmsNorm input 1 fused, else
    mul2's; whole on every rank)."""
    cell = mf.rsplit(".", 1)[0]
    if mf.endswith("embedding_weight"):
        return "gather", *records[cell + ".gather"]["in"][:2]
    if mf.endswith("norm.weight") or mf.endswith("norm_out.weight"):
        return "norm", records[cell + ".norm" if cell + ".norm" in records else cell + ".mul2"]["in"][1], None
    x, w = records[cell + ".matmul"]["in"][:2]
    return ("down" if mf.endswith("ffn.w2.weight") else "matmul"), w, x


def optimizer_places(owners: tuple[tuple[int, ...], ...], shape: tuple[int, ...], dim0_split: int,
                     shard_size: int, on: bool = True, threshold_kb: float = 0,
                     itemsize: int = 4) -> tuple[tuple[int, int], ...]:
    """Per rank of the stage, (its place, the group's size) in the group of ranks MindSpore's parallel
    optimizer splits dimension 0 of its slice over, (0, 1) where the weight stays whole, as
    OptParamMgr.SplitParam and OperatorInfo::CreateGroupForOptShard decide, on ranks, not mesh axes: a
    weight kept out (parallel_optimizer False) or under the threshold stays whole; group_devices, the ranks
    holding the same slice (`owners` equal), in rank order, are cut into consecutive groups of `shard_size`
    (all of them at -1), none where it does not divide their count or dimension 0 of the slice."""
    devices = len(owners)
    whole = ((0, 1),) * devices
    if not on or math.prod(shape) * itemsize < threshold_kb * 1024:
        return whole
    out = []
    for rank in range(devices):
        group = [r for r in range(devices) if owners[r] == owners[rank]]
        n = len(group) if shard_size == -1 else shard_size
        if n == 1 or len(group) % n or shape[0] % (dim0_split * n):
            return whole
        i = group.index(rank)
        out.append((i % n, n))
    return tuple(out)


def place_box(owner: tuple[int, ...], splits: tuple[int, ...], shape: tuple[int, ...],
              place: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of block `owner` of a tensor split `splits`, dimension 0 cut into place[1]
    parts of which the rank holds part place[0]: TensorLayout.shard_box's terms."""
    sizes = [s // k for s, k in zip(shape, splits)]
    offsets = [o * z for o, z in zip(owner, sizes)]
    sizes[0] //= place[1]
    offsets[0] += place[0] * sizes[0]
    return tuple(offsets), tuple(sizes)
