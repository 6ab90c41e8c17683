"""LLaMA in PyTorch, parameter for parameter the Hugging Face LlamaForCausalLM (and Qwen2/3,
Mixtral, Qwen3-MoE; with multi-latent attention (mla.py), DeepSeekMoE routing (moe.py) and
multi-token prediction (mtp.py), DeepseekV3ForCausalLM).

Names and shapes match transformers' (model.layers.N.self_attn.q_proj.weight, ...) except the
routed experts, stacked per layer (moe.py), and so does the rotary convention (rotate_half over
the two halves of each head), so a state dict moves between the two by a table. No parallelism here: torch_backend/parallelize applies it
from the ModelPlan. Layers live in a ModuleDict keyed by index, and forward skips modules
that are None, so a pipeline stage is this model with the other stages' parts removed.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ms_llm.config.model import ModelConfig
from ms_llm.init import init_param
from ms_llm.rope import inv_frequencies
from torch_backend.layers import MLP, RMSNorm, apply_rotary, rotate_half  # noqa: F401 (re-exported)
from torch_backend.mla import MLAttention
from torch_backend.moe import AuxLoss, MoE
from torch_backend.mtp import MTP


def rotary_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim), HF layout: the frequencies repeated twice, scaled
    by the rope scaling's attention factor (YaRN)."""
    inv_freq, attention_factor = inv_frequencies(cfg)
    # Computed on the CPU, then moved (to the meta device too, under a meta-device context, where
    # computing them would import torch._dynamo: over a second of each worker's start).
    t = torch.from_numpy(np.arange(cfg.max_seq_len, dtype=np.int64)).float()
    freqs = torch.outer(t, torch.from_numpy(inv_freq))
    emb = torch.cat((freqs, freqs), dim=-1)
    target = device if device is not None else torch.empty(0).device     # the default device in effect
    return (emb.cos() * attention_factor).to(target), (emb.sin() * attention_factor).to(target)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core: (B, nh, T, hs) queries, (B, nkv, T, hs) keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Context parallelism swaps in a core that attends across the cp group
        # (torch_backend/parallelize/cp.py); q/k/v are this rank's tokens.
        self.core = causal_attention
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.hidden_size, bias=False)
        # Qwen3: RMSNorm over each head's features, shared by all heads (replicated under tp).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The first T rotary rows: under sequence parallelism the caller only knows its shard
        # of the sequence, while attention sees the whole (gathered) sequence.
        cos, sin = cos[:T], sin[:T]
        # -1 heads: under tensor parallelism each rank sees only its local heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim)                   # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)                   # (B, T, nkv, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                        # (B, nh, T, hs), (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)                             # (B, T, nh*hs)
        return self.o_proj(y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm (and the multi-token prediction modules)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Given its weight, nn.Embedding skips its random init (init_weights fills every weight), whose
        # normal_ on the meta device would import torch._dynamo: over a second of each worker's start.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mtp = MTP(cfg, lambda i: DecoderLayer(cfg, i)) if cfg.mtp_layers else None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # False on a pipeline stage that keeps embed_tokens only for its MTP modules (the last
        # stage's copy, torch_backend.pipeline.cut_chunk): its input is hidden states.
        self.takes_tokens = True
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (B, T) -> logits (B, T, V); a pipeline stage takes / returns hidden states
        (B, T, H) when it takes no tokens / has no head. `targets` (B, T), when training a model with
        multi-token prediction: its loss trains with the logits (mtp.MTP, moe.AuxLoss)."""
        if positions is None:
            cos, sin = self.rope_cos, self.rope_sin                 # each attention takes its first T rows
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        emb = None
        if self.takes_tokens:
            x = emb = self.model.embed_tokens(x)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin)
        if self.model.norm is not None:
            x = self.model.norm(x)
        mtp = None
        if targets is not None and self.model.mtp is not None and torch.is_grad_enabled():
            if emb is None:      # the last pipeline stage: token i (i >= 1) is target i - 1; token 0 is never read
                emb = F.pad(self.model.embed_tokens(targets[:, :-1]), (0, 0, 1, 0))
            mtp = self.model.mtp.loss(emb, x, targets, self.lm_head, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(x)
        if mtp is not None:
            x = AuxLoss.apply(x, mtp, self.model.mtp)
        return x

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Same values as every other backend for the same seed (ms_llm.init)."""
        for name, p in self.named_parameters():
            p.copy_(torch.from_numpy(init_param(name, tuple(p.shape), seed, std)))
