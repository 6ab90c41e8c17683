"""Sparse mixture-of-experts feed-forward in MindSpore, parameter for parameter torch_backend/moe.py:
router `mlp.gate.weight` (E, H), routed experts stacked as `mlp.experts.{gate,up,down}_proj.weight`
(E, F, H) / (E, H, F), optional shared experts `mlp.shared_experts.*`.

Routing is the same (softmax in fp32, top_k, optional renormalisation, GShard capacity in token
order). Graph mode wants static shapes, so instead of sorting token copies by expert this layer
builds the (tokens, experts) combine matrix, zero outside each token's kept top-k, runs every
expert over the tokens as one BatchMatMul over the expert dimension (E, N, H) and sums the
weighted outputs: the same result as the sorted dispatch, at E / top_k times its expert FLOPs, a
data-parallel CPU path (expert parallelism on MindSpore is not lowered). The router losses join
the gradient through a pass-through cell with a custom bprop, as torch's AuxLoss does.
"""
from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.model import ModelConfig
from ms_llm.mindspore.model import MLP, Linear


class StackedLinear(nn.Cell):
    """`weight` (E, out, in): one Linear weight per expert, stacked along dim 0."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((experts, out_features, in_features), np.float32)), name="weight")


class Experts(nn.Cell):
    """Every expert over every token: (E, N, H) -> (E, N, H)."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = StackedLinear(experts, width, hidden)
        self.up_proj = StackedLinear(experts, width, hidden)
        self.down_proj = StackedLinear(experts, hidden, width)
        self.bmm_gate = ops.BatchMatMul(transpose_b=True)
        self.bmm_up = ops.BatchMatMul(transpose_b=True)
        self.bmm_down = ops.BatchMatMul(transpose_b=True)
        self.sigmoid = ops.Sigmoid()
        self.mul = ops.Mul()

    def construct(self, x):
        gate = self.bmm_gate(x, self.gate_proj.weight)                           # (E, N, F)
        h = self.mul(self.mul(gate, self.sigmoid(gate)), self.bmm_up(x, self.up_proj.weight))
        return self.bmm_down(h, self.down_proj.weight)                           # (E, N, H)


class AuxLoss(nn.Cell):
    """Identity on `y`; backward also sends `scale` into `aux` (the router losses)."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def construct(self, y, aux):
        return y

    def bprop(self, y, aux, out, dout):
        return dout, ops.ones_like(aux) * self.scale


class MoE(nn.Cell):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.hidden, self.num_experts, self.top_k, self.normalize = cfg.hidden_size, m.num_experts, m.top_k, \
            m.normalize_top_k
        self.aux_coeff, self.z_coeff = m.aux_loss_coeff, m.z_loss_coeff
        self.capacity_factor = m.capacity_factor
        self.gate = Linear(cfg.hidden_size, m.num_experts)
        self.experts = Experts(m.num_experts, cfg.hidden_size, cfg.expert_ffn_size)
        self.has_shared = m.shared_experts > 0
        if self.has_shared:
            self.shared_experts = MLP(cfg, width=m.shared_experts * cfg.expert_ffn_size)
        self.softmax = ops.Softmax(axis=-1)
        self.topk = ops.TopK(sorted=True)
        self.one_hot = ops.OneHot()
        self.cumsum = ops.CumSum()
        self.sum = ops.ReduceSum(keep_dims=False)
        self.mean = ops.ReduceMean(keep_dims=False)
        self.max = ops.ReduceMax(keep_dims=True)
        self.tile = ops.Tile()
        self.aux_loss = AuxLoss()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, x):
        return self.route(x)[0]

    def route(self, x):
        """(output, router losses): their gradient joins through AuxLoss, their value is for the
        reported loss (model.LossCell adds it with its gradient stopped, as torch's TrainStep does)."""
        b, t, h = x.shape
        n = b * t
        tokens = x.reshape((n, h))
        logits = self.gate(tokens)                                               # (N, E)
        probs = self.softmax(logits.astype(ms.float32))
        weights, top = self.topk(probs, self.top_k)                              # (N, k)
        if self.normalize:
            weights = weights / self.sum(weights, -1).reshape((n, 1))
        chosen = self.one_hot(top, self.num_experts, self.on, self.off)          # (N, k, E)
        kept = chosen
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * self.top_k / self.num_experts)
            # Position of each copy in its expert's queue, copies in token order (torch's stable sort).
            position = self.cumsum(chosen.reshape((n * self.top_k, self.num_experts)), 0).reshape(chosen.shape)
            kept = chosen * (position <= capacity).astype(ms.float32)
        combine = self.sum(kept * weights.reshape((n, self.top_k, 1)), 1)       # (N, E)
        out = self.experts(self.tile(tokens.reshape((1, n, h)), (self.num_experts, 1, 1)))    # (E, N, H)
        y = self.sum(out * combine.astype(x.dtype).T.reshape((self.num_experts, n, 1)), 0)  # (N, H)
        if self.has_shared:
            y = y + self.shared_experts(tokens)
        y = y.reshape((b, t, h))
        if self.aux_coeff > 0 or self.z_coeff > 0:
            aux = self.router_losses(logits, probs, chosen)
            return self.aux_loss(y, aux), aux
        return y, self.off

    def router_losses(self, logits, probs, chosen):
        """aux_coeff * E * sum_e f_e P_e + z_coeff * mean logsumexp(logits)^2 (torch_backend.moe)."""
        share = self.mean(self.sum(chosen, 1), 0) / self.top_k                  # f_e over the N*k copies
        balance = self.num_experts * self.sum(share * self.mean(probs, 0), 0)
        logits = logits.astype(ms.float32)
        peak = self.max(logits, -1)
        lse = ops.log(self.sum(ops.exp(logits - peak), -1)) + peak.squeeze(-1)     # logsumexp, stable
        z = self.mean(ops.square(lse), 0)
        return self.aux_coeff * balance + self.z_coeff * z
