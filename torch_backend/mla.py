"""Multi-latent attention (DeepSeek-V2/V3), parameter for parameter transformers' DeepseekV3Attention.

Queries come straight from the hidden state (q_proj) or through a low-rank path (q_a_proj ->
q_a_layernorm -> q_b_proj). Keys and values are expanded per head from one compressed latent
(kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj), and a rotary key of qk_rope_head_dim,
taken from the same projection, is shared by every head. Each head attends over
qk_nope_head_dim + qk_rope_head_dim and returns v_head_dim. The rotary tables are the model's,
built over cfg.rope_dim = qk_rope_head_dim. The latent norms take model.norm_eps, as Megatron-core's
do (transformers' and DeepSeek's own code fix them at 1e-6, the rms_norm_eps DeepSeek ships).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ms_llm.config.model import ModelConfig
from ms_llm.rope import yarn_mscale
from torch_backend.layers import RMSNorm, apply_rotary

def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times m(mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale):
    the temperature YaRN takes out of the rotary tables is put back into every score."""
    scale = cfg.mla.qk_head_dim ** -0.5
    r = cfg.rope_scaling
    if r.type == "yarn" and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over interleaved pairs (x0, x1), (x2, x3)... as DeepSeek lays them out; the result
    comes out de-interleaved (evens' rotations, then odds'), as transformers'
    apply_rotary_pos_emb_interleave returns it: q and k are permuted alike, so scores are unchanged.
    x: (B, nh, T, r); cos/sin: (T, r), the frequencies repeated twice."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, h = cfg.mla, cfg.hidden_size
        self.nope, self.rope, self.v_dim, self.kv_rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        self.qk_dim = a.qk_head_dim
        self.interleave = a.rope_interleave
        self.scale = softmax_scale(cfg)
        low_rank = a.q_lora_rank is not None                 # q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj
        self.q_proj = None if low_rank else nn.Linear(h, cfg.q_dim, bias=False)
        self.q_a_proj = nn.Linear(h, a.q_lora_rank, bias=False) if low_rank else None
        self.q_a_layernorm = RMSNorm(a.q_lora_rank, cfg.norm_eps) if low_rank else None
        self.q_b_proj = nn.Linear(a.q_lora_rank, cfg.q_dim, bias=False) if low_rank else None
        self.kv_a_proj_with_mqa = nn.Linear(h, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, cfg.num_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.attn_out_dim, h, bias=False)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, qk) queries and keys, (B, nh, T, v) values -> (B, nh, T, v)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        cos, sin = cos[:T], sin[:T]
        q = self.queries(x).view(B, T, -1, self.qk_dim).transpose(1, 2)          # (B, nh, T, qk)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        k_rot = k_rot.view(B, 1, T, self.rope)                                    # one rotary key for all heads
        q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)                      # (B, nh, T, nope), (B, nh, T, v)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))                  # (B, T, nh*v) -> (B, T, H)
