"""The MindSpore model's building blocks shared by the dense model (model.py), the MoE layer
(moe.py), multi-latent attention (mla.py) and multi-token prediction (mtp.py): a Linear laid out
as one 2-D MatMul (what the lowering's strategies address), RMSNorm, the rotary rotation and the
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


class RMSNorm(nn.Cell):
    """x * rsqrt(mean(x^2) + eps) * weight, built from primitives MindFormers shards one by one."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(Tensor(np.ones((dim,), np.float32)), name="weight")
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.add = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()
        self.mul2 = ops.Mul()

    def construct(self, x):
        factor = self.rsqrt(self.add(self.mean(self.square(x), -1), self.eps))
        return self.mul2(self.mul(x, factor), self.weight)


class Rotary(nn.Cell):
    """x * cos + rotate_half(x) * sin on (B, heads, T, head_dim)."""

    def __init__(self):
        super().__init__()
        self.split = ops.Split(axis=-1, output_num=2)
        self.neg = ops.Neg()
        self.concat = ops.Concat(axis=-1)
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add = ops.Add()

    def construct(self, x, cos, sin):
        x1, x2 = self.split(x)
        rotated = self.concat((self.neg(x2), x1))
        return self.add(self.mul_cos(x, cos), self.mul_sin(rotated, sin))


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
