"""Sparse mixture-of-experts feed-forward in MindSpore, parameter for parameter torch_backend/moe.py:
router `mlp.gate.weight` (E, H), routed experts stacked as `mlp.experts.{gate,up,down}_proj.weight`
(E, F, H) / (E, H, F), optional shared experts `mlp.shared_experts.*`.

Routing is the spec's (transformers' DeepseekV3TopkRouter, Megatron's topk router): logits in
fp32, softmax or sigmoid scores; the choice is the scores plus, with expert_bias, the fp32
`mlp.gate.e_score_correction_bias` (a non-trainable Parameter that only steers selection; the
training step moves it after each update, ExpertBiasUpdate); group-limited top-k keeps the best
group_top_k of num_groups groups; the weights are the scores at the top_k, optionally
renormalised, times routed_scaling_factor.

Dispatch is capacity-based with static shapes, as MindFormers' own MoE (MoEV2) under
semi_auto_parallel. The tokens form `token_groups` groups of n consecutive tokens (1 group on one
device or per data-parallel rank; dp*cp groups under semi_auto_parallel, set by apply.py, so each
rank's tokens are one group, the torch backend's capacity under data parallel). Each expert takes
the first C = min(ceil(capacity_factor * n * top_k / E), n) copies routed to it in its group, in
token order (GShard, torch's capacity drop; an expert cannot get more than n copies, so the min
drops nothing): a CumSum gives each copy its place in its expert's queue. TopK over those places
picks the token of every (expert, slot); a Gather fills the (groups, E, C, H) buffer; the experts
run as one BatchMatMul per projection over (E, groups * C, H), so each token costs top_k x
capacity_factor expert MLPs, not E; a Gather by each kept copy's slot brings the outputs back,
weighted by the routing weights (0 for a dropped copy). Empty slots compute on some token and are
never read. Under semi_auto_parallel (lower_moe.py) the buffer's groups split over dp*cp = edp x ep
on the way in and out; the transposes to and from the experts' (E over ep, groups over edp) layout
are where MindSpore puts the all-to-all over ep, as around MindFormers' transpose_5dim_ep2.

Dropless (capacity_factor -1) is C = n: every expert has a slot for every token of its group, the
worst case of capacity dispatch, exact, at E / top_k times the expert FLOPs of the routed copies
(the cost of running every expert over every token). moe.use_gmm drops nothing for less, as
MindFormers' MoEV3 (use_gmm): per group, the n*k copies (choice-major) are sorted by expert id, a
Gather brings the tokens in that order, the copies per expert are counted, and GroupedExperts runs
each expert's consecutive rows through its three projections with GroupedMatmul (group_list = the
running count); a second sort (of the sort map) gives each copy its row, and a Gather by it brings
the outputs back to (n, k), weighted and summed as above. GroupedMatmul has only an Ascend kernel
(MindSpore 2.10 refuses it on CPU), so support.py refuses use_gmm elsewhere; GroupedExperts'
`matmul` is the one swappable piece (tests/mindspore/test_ms_moe_gmm.py checks the index math on
CPU with an exact per-group matmul in its place).

Every computation is a Primitive attribute, so the lowering shards each one. The router losses
(Switch load balancing, z-loss, DeepSeek-V3's sequence-wise loss) are returned beside the output
and added to the loss (model.LossCell), as MindFormers adds its MoE extra_loss: their gradient is
then scaled with the loss (loss scale, micro-batch mean) like every other. Beside them comes each
expert's load (the token copies routed to it, dropped ones included, as torch counts them), which
the training step sums for the bias update.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.model import ModelConfig
from ms_llm.mindspore.layers import MLP, Linear
from ms_llm.mindspore.lower_moe import expert_capacity


class StackedLinear(nn.Cell):
    """`weight` (E, out, in): one Linear weight per expert, stacked along dim 0."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((experts, out_features, in_features), np.float32)), name="weight")


class Experts(nn.Cell):
    """Each expert over its own rows: (E, M, H) -> (E, M, H), SwiGLU per expert, one BatchMatMul
    per projection."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = StackedLinear(experts, width, hidden)
        self.up_proj = StackedLinear(experts, width, hidden)
        self.down_proj = StackedLinear(experts, hidden, width)
        self.bmm_gate = ops.BatchMatMul(transpose_b=True)
        self.bmm_up = ops.BatchMatMul(transpose_b=True)
        self.bmm_down = ops.BatchMatMul(transpose_b=True)
        self.sigmoid = ops.Sigmoid()
        self.silu_mul = ops.Mul()
        self.mul = ops.Mul()

    def construct(self, x):
        gate = self.bmm_gate(x, self.gate_proj.weight)                           # (E, M, F)
        h = self.mul(self.silu_mul(gate, self.sigmoid(gate)), self.bmm_up(x, self.up_proj.weight))
        return self.bmm_down(h, self.down_proj.weight)                           # (E, M, H)


class GroupedMatmul(nn.Cell):
    """x (M, in) rows sorted by expert, w (E, out, in), group_list (E,) int64 running row counts ->
    (M, out): rows group_list[e-1]:group_list[e] times w[e]^T. MindSpore's GroupedMatmul, Ascend only."""

    def __init__(self):
        super().__init__()
        self.gmm = ops.auto_generate.GroupedMatmul(split_item=3, group_type=0, transpose_b=True)

    def construct(self, x, w, group_list):
        return self.gmm([x], [w], None, None, None, None, None, group_list)[0]


class GroupedExperts(nn.Cell):
    """Dropless experts on each token group's copies sorted by expert: (G, M, H) rows and (G, E) copies per
    expert -> (G, M, H), SwiGLU per expert, one grouped matmul per projection and group (MoEV3's FFN; the
    same weights as Experts)."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = StackedLinear(experts, width, hidden)
        self.up_proj = StackedLinear(experts, width, hidden)
        self.down_proj = StackedLinear(experts, hidden, width)
        self.matmul = GroupedMatmul()
        self.cumsum = ops.CumSum()                           # group_list: the end row of each expert
        self.sigmoid = ops.Sigmoid()
        self.silu_mul = ops.Mul()
        self.mul = ops.Mul()

    def construct(self, x, counts):
        group_lists = self.cumsum(counts, 1).astype(ms.int64)                   # (G, E): each expert's end row
        return ops.stack([self.swiglu(x[i], group_lists[i]) for i in range(x.shape[0])])

    def swiglu(self, rows, group_list):
        gate = self.matmul(rows, self.gate_proj.weight, group_list)              # (M, F)
        hidden = self.mul(self.silu_mul(gate, self.sigmoid(gate)), self.matmul(rows, self.up_proj.weight, group_list))
        return self.matmul(hidden, self.down_proj.weight, group_list)            # (M, H)


class RouterLosses(nn.Cell):
    """aux_coeff * E * sum_e f_e P_e + z_coeff * mean logsumexp(logits)^2 (torch_backend.moe)."""

    def __init__(self, experts: int, top_k: int, aux_coeff: float, z_coeff: float):
        super().__init__()
        self.experts, self.top_k, self.aux_coeff, self.z_coeff = experts, top_k, aux_coeff, z_coeff
        self.sum_copies = ops.ReduceSum(keep_dims=False)     # (N, k, E) -> (N, E)
        self.mean_tokens = ops.ReduceMean(keep_dims=False)   # (N, E) -> (E,)
        self.mul = ops.Mul()
        self.sum_experts = ops.ReduceSum(keep_dims=False)    # (E,) -> ()
        self.max = ops.ReduceMax(keep_dims=True)             # logsumexp, stable: (N, E) -> (N, 1)
        self.sub = ops.Sub()
        self.exp = ops.Exp()
        self.sum = ops.ReduceSum(keep_dims=False)
        self.log = ops.Log()
        self.add = ops.Add()
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=False)

    def construct(self, logits, probs, chosen):
        share = self.mean_tokens(self.sum_copies(chosen, 1), 0) / self.top_k    # f_e over the N*k copies
        balance = self.experts * self.sum_experts(self.mul(share, self.mean_tokens(probs, 0)), 0)
        peak = self.max(logits, -1)
        lse = self.add(self.log(self.sum(self.exp(self.sub(logits, peak)), -1)), peak.squeeze(-1))
        return self.aux_coeff * balance + self.z_coeff * self.mean(self.square(lse), 0)


class SequenceAuxLoss(nn.Cell):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20): per sequence of T tokens f_e = E / (k T)
    x #{t: e chosen at t}, P_e = mean_t s'_{t,e}; coeff x the mean over sequences of sum_e f_e P_e."""

    def __init__(self, experts: int, top_k: int, coeff: float):
        super().__init__()
        self.experts, self.top_k, self.coeff = experts, top_k, coeff
        self.sum_copies = ops.ReduceSum(keep_dims=False)     # (B, T, k, E) -> (B, T, E)
        self.sum_tokens = ops.ReduceSum(keep_dims=False)     # (B, T, E) -> (B, E)
        self.mean_tokens = ops.ReduceMean(keep_dims=False)   # (B, T, E) -> (B, E)
        self.mul = ops.Mul()
        self.sum_experts = ops.ReduceSum(keep_dims=False)    # (B, E) -> (B,)
        self.mean = ops.ReduceMean(keep_dims=False)

    def construct(self, probs, chosen):
        """probs (B, T, E) normalised scores, chosen (B, T, k, E) one-hot choices."""
        t = probs.shape[1]
        share = self.sum_tokens(self.sum_copies(chosen, 2), 1) * (self.experts / (self.top_k * t))
        return self.coeff * self.mean(self.sum_experts(self.mul(share, self.mean_tokens(probs, 1)), 1), 0)


class GroupLimit(nn.Cell):
    """Group-limited routing: a group scores the sum of its best `per_group_top` choices; the experts
    outside the best `keep` groups are masked to -inf. (N, E) -> (N, E)."""

    def __init__(self, experts: int, groups: int, keep: int, per_group_top: int):
        super().__init__()
        self.experts, self.groups, self.keep, self.per_group_top = experts, groups, keep, per_group_top
        self.topk = ops.TopK(sorted=True)                    # (N, G, E/G) -> (N, G, per_group_top)
        self.sum = ops.ReduceSum(keep_dims=False)            # -> (N, G) group scores
        self.topk_groups = ops.TopK(sorted=True)             # -> (N, keep) group ids
        self.one_hot = ops.OneHot()                          # -> (N, keep, G)
        self.sum_kept = ops.ReduceSum(keep_dims=False)       # -> (N, G) 1 for a kept group
        self.tile = ops.Tile()                               # -> (N, G, E/G)
        self.greater = ops.Greater()
        self.select = ops.Select()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        self.neg_inf = Tensor(float("-inf"), ms.float32)

    def construct(self, choice):
        n, per_group = choice.shape[0], self.experts // self.groups
        best, _ = self.topk(choice.reshape((n, self.groups, per_group)), self.per_group_top)
        _, groups = self.topk_groups(self.sum(best, -1), self.keep)
        kept = self.sum_kept(self.one_hot(groups, self.groups, self.on, self.off), 1)
        kept = self.tile(kept.reshape((n, self.groups, 1)), (1, 1, per_group)).reshape((n, self.experts))
        return self.select(self.greater(kept, self.off), choice, self.neg_inf.broadcast_to(choice.shape))


class Router(Linear):
    """`mlp.gate`: the router's Linear (E, H) and, with expert_bias, its fp32
    `e_score_correction_bias` (E,), a Parameter outside the optimizer (requires_grad False)."""

    def __init__(self, hidden: int, experts: int, expert_bias: bool):
        super().__init__(hidden, experts)
        if expert_bias:
            self.e_score_correction_bias = Parameter(Tensor(np.zeros((experts,), np.float32)),
                                                     name="e_score_correction_bias", requires_grad=False)


class ExpertBiasUpdate(nn.Cell):
    """Aux-loss-free balancing (DeepSeek-V3), after each optimizer step: per MoE layer, bias +=
    rate x sign(mean(load) - load), in fp32. `loads` (layers, E) are the token copies routed to each
    expert over the whole step (every micro-batch); with `world` > 1 (data parallel on a CPU
    machine) they are summed over the ranks first, so every rank moves its biases alike (under
    semi_auto_parallel the sum over the sharded tokens already spans them)."""

    def __init__(self, biases: list[Parameter], rate: float, world: int = 1):
        super().__init__()
        self.biases, self.rate, self.reduce = ms.ParameterTuple(biases), rate, world > 1
        if self.reduce:
            self.all_reduce = ops.AllReduce()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.sign = ops.Sign()

    def construct(self, loads):
        """Moves the biases; returns the loads they were moved by (summed over the ranks)."""
        if self.reduce:
            loads = self.all_reduce(loads)
        step = self.rate * self.sign(self.mean(loads, -1) - loads)           # (layers, E)
        for i in range(len(self.biases)):        # the depend chain keeps every assignment in the graph
            loads = ops.depend(loads, ops.assign(self.biases[i], self.biases[i] + step[i]))
        return loads


class MoE(nn.Cell):
    """The MoE feed-forward (module docstring); `token_groups` is set per layout by set_token_groups."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.moe_config = m
        self.hidden, self.num_experts, self.top_k, self.normalize = cfg.hidden_size, m.num_experts, m.top_k, \
            m.normalize_top_k
        self.token_groups = 1
        self.has_losses = m.aux_loss_coeff > 0 or m.z_loss_coeff > 0
        self.has_seq_loss = m.seq_aux_loss_coeff > 0
        self.sigmoid_scores, self.expert_bias = m.score_function == "sigmoid", m.expert_bias
        self.num_groups, self.group_top_k, self.scaling = m.num_groups, m.group_top_k, m.routed_scaling_factor
        self.gate = Router(cfg.hidden_size, m.num_experts, m.expert_bias)
        self.use_gmm = m.use_gmm
        self.experts = (GroupedExperts if m.use_gmm else Experts)(m.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.has_shared = m.shared_experts > 0
        if self.has_shared:
            self.shared_experts = MLP(cfg, width=m.shared_experts * cfg.expert_ffn_size)
            self.add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        if self.sigmoid_scores:
            self.sigmoid = ops.Sigmoid()
            self.sum_scores = ops.ReduceSum(keep_dims=True)  # s' = scores / sum: what the losses average
            self.div_scores = ops.RealDiv()
        if m.expert_bias:
            self.add_bias = ops.Add()                        # (N, E) + (E,): the choice
            self.sum_load = ops.ReduceSum(keep_dims=False)   # (N, k, E) -> (E,): copies per expert
        if m.num_groups > 1:
            self.limit_groups = GroupLimit(m.num_experts, m.num_groups, m.group_top_k, m.top_k // m.group_top_k)
        self.choice_apart = m.expert_bias or m.num_groups > 1
        self.topk = ops.TopK(sorted=True)
        if self.choice_apart:
            self.gather = ops.GatherD()                      # the scores (not the choice) at the top_k
        self.sum_top = ops.ReduceSum(keep_dims=True)         # renormalisation: (N, k) -> (N, 1)
        self.div = ops.RealDiv()
        if self.scaling != 1.0:
            self.mul_scaling = ops.Mul()
        self.one_hot = ops.OneHot()                          # (N, k) -> (N, k, E)
        if m.use_gmm:      # dropless by sorting, per token group (MoEV3's _tensor_sort / _tensor_unsort)
            self.transpose_ids = ops.Transpose()             # (G, n, k) -> (G, k, n): copies choice-major
            self.sort = ops.Sort(axis=1)                     # (G, k*n) expert ids -> the copies in expert order
            self.mod = ops.Mod()                             # a sorted copy's token: its index mod n
            self.gather_sort = ops.Gather(batch_dims=1)      # (G, n, H) at (G, k*n) -> (G, k*n, H)
            self.sum_counts = ops.ReduceSum(keep_dims=False)  # (G, n*k, E) -> (G, E): copies per expert
            self.sort_back = ops.Sort(axis=1)                # of the sort map: each copy's row among the sorted
            self.transpose_unsort = ops.Transpose()          # (G, k, n) -> (G, n, k)
            self.gather_unsort = ops.Gather(batch_dims=1)    # (G, k*n, H) at (G, n, k) -> (G, n, k, H), then
                                                             # mul_combine and sum_copies over k as below
        # Capacity, per token group (G, n*k copies, E), copies in token order:
        self.cumsum = ops.CumSum()                           # each copy's place in its expert's queue (1-based)
        self.less_equal = ops.LessEqual()                    # within capacity C
        self.mul_kept = ops.Mul()
        self.sub_priority = ops.Sub()                        # C + 1 - place: the earliest copy ranks highest
        self.mul_priority = ops.Mul()
        self.sum_choices = ops.ReduceSum(keep_dims=False)    # (G, n, k, E) -> (G, n, E): a token's copy per expert
        self.transpose_kept = ops.Transpose()                # -> (G, E, n)
        self.topk_slots = ops.TopK(sorted=True)              # -> (G, E, C): the token in each slot, in queue order
        self.mul_offsets = ops.Mul()                         # expert e's slots start at e * C
        self.add_slots = ops.Add()                           # place + e * C - 1: each copy's slot in (E * C)
        self.mul_slots = ops.Mul()
        self.sum_slots = ops.ReduceSum(keep_dims=False)      # (G, n*k, E) -> (G, n*k)
        self.sum_kept = ops.ReduceSum(keep_dims=False)       # (G, n*k, E) -> (G, n*k): 1 kept, 0 dropped
        self.mul_weights = ops.Mul()                         # the routing weight of kept copies, 0 of dropped
        # Dispatch, experts, combine:
        self.dispatch = ops.Gather(batch_dims=1)             # (G, n, H) at (G, E, C) -> (G, E, C, H)
        self.transpose_in = ops.Transpose()                  # -> (E, G, C, H): all-to-all over ep before it
        self.transpose_out = ops.Transpose()                 # -> (G, E, C, H): all-to-all over ep before it
        self.combine = ops.Gather(batch_dims=1)              # (G, E*C, H) at (G, n*k) -> (G, n*k, H)
        self.mul_combine = ops.Mul()
        self.sum_copies = ops.ReduceSum(keep_dims=False)     # (G, n, k, H) -> (G, n, H)
        self.expert_ids = Tensor(np.arange(m.num_experts, dtype=np.float32))
        self.router_losses = RouterLosses(m.num_experts, m.top_k, m.aux_loss_coeff, m.z_loss_coeff)
        if self.has_seq_loss:
            self.seq_aux_loss = SequenceAuxLoss(m.num_experts, m.top_k, m.seq_aux_loss_coeff)
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, x):
        return self.route(x)[0]

    def route(self, x):
        """(output, router losses, copies routed to each expert (E,) fp32): model.LossCell adds the
        losses to the training loss; the training step sums the loads for the bias update."""
        b, t, h = x.shape
        n = b * t
        tokens = x.reshape((n, h))
        logits = self.gate(tokens).astype(ms.float32)                           # (N, E)
        if self.sigmoid_scores:
            scores = self.sigmoid(logits)
            probs = self.div_scores(scores, self.sum_scores(scores, -1) + 1e-20)     # s': sums to 1, for the losses
        else:
            scores = probs = self.softmax(logits)
        if self.choice_apart:
            choice = scores
            if self.expert_bias:
                choice = self.add_bias(scores, self.gate.e_score_correction_bias)
            if self.num_groups > 1:
                choice = self.limit_groups(choice)
            _, top = self.topk(choice, self.top_k)                               # (N, k)
            weights = self.gather(scores, 1, top)
        else:
            weights, top = self.topk(scores, self.top_k)
        if self.normalize:
            weights = self.div(weights, self.sum_top(weights, -1) + 1e-20)
        if self.scaling != 1.0:
            weights = self.mul_scaling(weights, self.scaling)
        chosen = self.one_hot(top, self.num_experts, self.on, self.off)          # (N, k, E)
        if self.use_gmm:
            y = self.dispatch_sorted(tokens, top, chosen, weights.astype(x.dtype)).reshape((b, t, h))
        else:
            y = self.dispatch_combine(tokens, chosen, weights.astype(x.dtype)).reshape((b, t, h))
        if self.has_shared:
            y = self.add(y, self.shared_experts(x))
        losses = self.off
        if self.has_losses:
            losses = losses + self.router_losses(logits, probs, chosen)
        if self.has_seq_loss:
            losses = losses + self.seq_aux_loss(probs.reshape((b, t, self.num_experts)),
                                                chosen.reshape((b, t, self.top_k, self.num_experts)))
        load = self.off
        if self.expert_bias:
            load = ops.stop_gradient(self.sum_load(chosen, (0, 1)))
        return y, losses, load

    def dispatch_combine(self, tokens, chosen, weights):
        """tokens (N, H), chosen (N, k, E) one-hot, weights (N, k) -> (N, H): the kept copies through
        their experts by capacity dispatch, weighted and summed per token."""
        n, h = tokens.shape
        g, e, k = self.token_groups, self.num_experts, self.top_k
        per = n // g                                                             # tokens per group
        cap = expert_capacity(self.moe_config, per)
        chosen = ops.stop_gradient(chosen).reshape((g, per * k, e))
        place = self.cumsum(chosen, 1)                                           # (G, n*k, E)
        kept = self.mul_kept(chosen, self.less_equal(place, cap).astype(ms.float32))
        priority = self.mul_priority(kept, self.sub_priority(cap + 1, place))
        per_token = self.sum_choices(priority.reshape((g, per, k, e)), 2)       # (G, n, E)
        _, slot_tokens = self.topk_slots(self.transpose_kept(per_token, (0, 2, 1)), cap)     # (G, E, C)
        slots = self.sum_slots(self.mul_slots(kept, self.add_slots(place, self.mul_offsets(self.expert_ids, cap) - 1)),
                               -1).astype(ms.int32)                              # (G, n*k)
        weights = self.mul_weights(weights.reshape((g, per * k)), self.sum_kept(kept, -1).astype(weights.dtype))
        buffer = self.dispatch(tokens.reshape((g, per, h)), slot_tokens, 1)      # (G, E, C, H)
        rows = self.transpose_in(buffer, (1, 0, 2, 3)).reshape((e, g * cap, h))
        out = self.experts(rows).reshape((e, g, cap, h))
        out = self.transpose_out(out, (1, 0, 2, 3)).reshape((g, e * cap, h))
        copies = self.mul_combine(self.combine(out, slots, 1), weights.reshape((g, per * k, 1)))
        return self.sum_copies(copies.reshape((g, per, k, h)), 2).reshape((n, h))


    def dispatch_sorted(self, tokens, top, chosen, weights):
        """tokens (N, H), top (N, k) expert ids, chosen (N, k, E) one-hot, weights (N, k) -> (N, H): every
        copy through its expert, grouped by sorting (dropless, use_gmm), weighted and summed per token."""
        n, h = tokens.shape
        g, e, k = self.token_groups, self.num_experts, self.top_k
        per = n // g
        ids = self.transpose_ids(ops.stop_gradient(top).reshape((g, per, k)), (0, 2, 1)).reshape((g, k * per))
        _, order = self.sort(ids.astype(ms.float32))                             # (G, k*n): copy c = (c // n, c % n)
        rows = self.gather_sort(tokens.reshape((g, per, h)), self.mod(order, per), 1)      # (G, k*n, H)
        counts = self.sum_counts(ops.stop_gradient(chosen).reshape((g, per * k, e)), 1)     # (G, E)
        _, place = self.sort_back(order.astype(ms.float32))                      # (G, k*n): copy -> its sorted row
        place = self.transpose_unsort(place.reshape((g, k, per)), (0, 2, 1))     # (G, n, k)
        out = self.experts(rows, counts)                                         # (G, k*n, H)
        copies = self.mul_combine(self.gather_unsort(out, place, 1), weights.reshape((g, per, k, 1)))
        return self.sum_copies(copies, 2).reshape((n, h))


def set_token_groups(net: nn.Cell, groups: int) -> None:
    """Every MoE layer of `net` forms its capacity groups of tokens over `groups` groups: 1 on one
    device and under data parallel (each rank's batch), dp*cp under semi_auto_parallel
    (lower_moe.token_groups), where each group is one rank's tokens."""
    for _, cell in net.cells_and_names():
        if isinstance(cell, MoE):
            cell.token_groups = groups
