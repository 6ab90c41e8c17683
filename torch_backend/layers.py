"""The torch model's building blocks shared by the dense model (model.py) and the MoE layer
(moe.py): the SwiGLU MLP, also the MoE layer's shared experts at their own width. The MindSpore
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
