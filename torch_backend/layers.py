"""The torch model's building blocks shared by the dense model (model.py), the MoE layer (moe.py),
multi-latent attention (mla.py) and multi-token prediction (mtp.py): RMSNorm, the rotate_half
rotary, and the SwiGLU MLP, also the MoE layer's shared experts at their own width. The MindSpore
backend's layers.py holds the same MLP (and its Linear; here torch.nn has one)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ms_llm.config.model import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: Optional[int] = None):
        super().__init__()
        width = width or cfg.ffn_hidden_size          # MoE shared experts: their own width
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)   # normalise in fp32
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hs); cos/sin: (T, hs)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
