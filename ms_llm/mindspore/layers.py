"""The MindSpore model's building blocks shared by the dense model (model.py) and the MoE layer
(moe.py): a Linear laid out as one 2-D MatMul (what the lowering's strategies address) and the
SwiGLU MLP, also the MoE layer's shared experts at their own width. torch_backend/layers.py
holds the same MLP (torch.nn has the Linear)."""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.config.model import ModelConfig


class Linear(nn.Cell):
    """y = x W^T (+ b) with W [out, in]; x is flattened to (tokens, in) for one 2-D MatMul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(Tensor(np.zeros((out_features, in_features), np.float32)), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.reshape = ops.Reshape()
        self.has_bias = bias
        if bias:
            self.bias = Parameter(Tensor(np.zeros((out_features,), np.float32)), name="bias")
            self.bias_add = ops.Add()

    def construct(self, x):
        lead = x.shape[:-1]
        y = self.matmul(self.reshape(x, (-1, self.in_features)), self.weight)
        if self.has_bias:
            y = self.bias_add(y, self.bias)                  # (tokens, out) + (out,)
        return self.reshape(y, lead + (self.out_features,))


class MLP(nn.Cell):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.ffn_hidden_size          # MoE shared experts: their own width
        self.gate_proj = Linear(cfg.hidden_size, width)
        self.up_proj = Linear(cfg.hidden_size, width)
        self.down_proj = Linear(width, cfg.hidden_size)
        self.sigmoid = ops.Sigmoid()        # silu = x * sigmoid(x): mint silu is not on every target
        self.silu_mul = ops.Mul()
        self.mul = ops.Mul()

    def construct(self, x):
        gate = self.gate_proj(x)
        return self.down_proj(self.mul(self.silu_mul(gate, self.sigmoid(gate)), self.up_proj(x)))
