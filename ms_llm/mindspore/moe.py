"""Sparse mixture-of-experts feed-forward in MindSpore, parameter for parameter torch_backend/moe.py:
router `mlp.gate.weight` (E, H), routed experts stacked as `mlp.experts.{gate,up,down}_proj.weight`
(E, F, H) / (E, H, F), optional shared experts `mlp.shared_experts.*`.

Routing is the same (softmax in fp32, top_k, optional renormalisation, GShard capacity in token
order). Graph mode wants static shapes, so instead of sorting token copies by expert this layer
builds the (tokens, experts) combine matrix, zero outside each token's kept top-k, runs every
expert over the tokens as one BatchMatMul over the expert dimension (E, N, H) and sums the
weighted outputs: the same result as the sorted dispatch, at E / top_k times its expert FLOPs.
Under semi_auto_parallel (lower.py) E splits over ep and the tokens over edp, so each rank runs
its own experts over its expert-data-parallel group's tokens (an all-gather dispatch over ep) and
the sum over experts is an all-reduce over ep. Every computation is a Primitive attribute, so
the lowering shards each one. The router losses are returned beside the output and added to the
loss (model.LossCell), as MindFormers adds its MoE extra_loss: their gradient is then scaled with
the loss (loss scale, micro-batch mean) like every other.
"""
from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.model import ModelConfig
from ms_llm.mindspore.layers import MLP, Linear


class StackedLinear(nn.Cell):
    """`weight` (E, out, in): one Linear weight per expert, stacked along dim 0."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((experts, out_features, in_features), np.float32)), name="weight")


class Experts(nn.Cell):
    """Every expert over every token it is given: (E, N, H) -> (E, N, H), SwiGLU per expert."""

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
        gate = self.bmm_gate(x, self.gate_proj.weight)                           # (E, N, F)
        h = self.mul(self.silu_mul(gate, self.sigmoid(gate)), self.bmm_up(x, self.up_proj.weight))
        return self.bmm_down(h, self.down_proj.weight)                           # (E, N, H)


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


class MoE(nn.Cell):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.hidden, self.num_experts, self.top_k, self.normalize = cfg.hidden_size, m.num_experts, m.top_k, \
            m.normalize_top_k
        self.capacity_factor = m.capacity_factor
        self.has_losses = m.aux_loss_coeff > 0 or m.z_loss_coeff > 0
        self.gate = Linear(cfg.hidden_size, m.num_experts)
        self.experts = Experts(m.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.has_shared = m.shared_experts > 0
        if self.has_shared:
            self.shared_experts = MLP(cfg, width=m.shared_experts * cfg.expert_ffn_size)
            self.add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.topk = ops.TopK(sorted=True)
        self.sum_top = ops.ReduceSum(keep_dims=True)         # renormalisation: (N, k) -> (N, 1)
        self.div = ops.RealDiv()
        self.one_hot = ops.OneHot()                          # (N, k) -> (N, k, E)
        self.cumsum = ops.CumSum()                           # capacity: queue positions in token order
        self.less_equal = ops.LessEqual()
        self.mul_kept = ops.Mul()
        self.mul_weights = ops.Mul()
        self.sum_copies = ops.ReduceSum(keep_dims=False)     # (N, k, E) -> (N, E)
        self.transpose = ops.Transpose()                     # (N, E) -> (E, N)
        self.tile = ops.Tile()                               # (1, N, H) -> (E, N, H)
        self.mul_combine = ops.Mul()
        self.sum_experts = ops.ReduceSum(keep_dims=False)    # (E, N, H) -> (N, H)
        self.router_losses = RouterLosses(m.num_experts, m.top_k, m.aux_loss_coeff, m.z_loss_coeff)
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, x):
        return self.route(x)[0]

    def route(self, x):
        """(output, router losses): model.LossCell adds the losses to the training loss."""
        b, t, h = x.shape
        n = b * t
        tokens = x.reshape((n, h))
        logits = self.gate(tokens).astype(ms.float32)                           # (N, E)
        probs = self.softmax(logits)
        weights, top = self.topk(probs, self.top_k)                              # (N, k)
        if self.normalize:
            weights = self.div(weights, self.sum_top(weights, -1))
        chosen = self.one_hot(top, self.num_experts, self.on, self.off)          # (N, k, E)
        kept = chosen
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * self.top_k / self.num_experts)
            # Position of each copy in its expert's queue, copies in token order (torch's stable sort).
            position = self.cumsum(chosen.reshape((n * self.top_k, self.num_experts)), 0).reshape(chosen.shape)
            kept = self.mul_kept(chosen, self.less_equal(position, capacity).astype(ms.float32))
        combine = self.sum_copies(self.mul_weights(kept, weights.reshape((n, self.top_k, 1))), 1)   # (N, E)
        out = self.experts(self.tile(tokens.reshape((1, n, h)), (self.num_experts, 1, 1)))    # (E, N, H)
        weight = self.transpose(combine.astype(x.dtype), (1, 0)).reshape((self.num_experts, n, 1))
        y = self.sum_experts(self.mul_combine(out, weight), 0).reshape((b, t, h))
        if self.has_shared:
            y = self.add(y, self.shared_experts(x))
        if self.has_losses:
            return y, self.router_losses(logits, probs, chosen)
        return y, self.off
