"""Multi-token prediction (DeepSeek-V3 section 2.2, eq. 21-25): D modules after the main model, module
d = k - 1 predicting token i + 1 + k at position i from the shared embedding of token i + k and the
previous depth's hidden state.

    h_0   = the main model's final hidden state after model.norm (the lm_head input)
    e_k   = embed_tokens(token[i + k]), the zero vector for i + k >= T
    h'_k  = eh_proj(cat[enorm(e_k), hnorm(h_{k-1})])        (embedding first: Megatron-core, DeepSeek's checkpoint)
    h_k   = decoder layer(h'_k), same rotary positions
    logits_k = lm_head(norm(h_k))                            (the main model's lm_head)
    mtp_loss = mtp_loss_factor x mean_k (cross-entropy over i < T - k, target labels[i + k])

Parameters: model.mtp.{d}.{enorm, hnorm, eh_proj, layer.<decoder layer>, norm}; the checkpoint
interop maps them to DeepSeek's model.layers.{num_layers + d}.* (ms_llm.checkpoint.interop.hf_deepseek).
The loss reaches training the way the MoE aux losses do: moe.AuxLoss, a pass-through on the
logits, sends `aux_scale` into it in backward and records its value in `aux_trained`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ms_llm.config.model import ModelConfig
from torch_backend.layers import RMSNorm


class MTPModule(nn.Module):
    """One depth: fuse the shifted embedding with the previous depth's state, then a decoder layer."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.norm_eps)
        self.hnorm = RMSNorm(h, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = layer
        self.norm = RMSNorm(h, cfg.norm_eps)          # DeepSeek's shared_head.norm, before the shared lm_head

    def forward(self, emb: torch.Tensor, prev: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, H) shifted embeddings and h_{k-1} -> h_k (before `norm`)."""
        return self.layer(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev)], dim=-1)), cos, sin)


class MTP(nn.ModuleDict):
    """The D modules keyed "0".."D-1", with the training-time state of their loss (as an MoE layer
    holds its aux losses'): `aux_scale` is the gradient weight TrainStep sets, `aux_trained` the
    values of the micro-batches backpropagated since taken."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__({str(d): MTPModule(cfg, make_layer(cfg.num_layers + d)) for d in range(cfg.mtp_layers)})
        self.factor = cfg.mtp_loss_factor
        self.aux_scale = 1.0
        self.aux_trained: list[torch.Tensor] = []

    def loss(self, emb: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """mtp_loss of one micro-batch. emb (B, T, H): the main model's token embeddings; hidden
        (B, T, H): h_0; targets (B, T): labels[i] = token i + 1."""
        T = emb.shape[1]
        losses, h = [], hidden
        for k, module in enumerate(self.values(), 1):
            shifted = F.pad(emb[:, k:], (0, 0, 0, k))                      # e_k: token i + k, zeros past the end
            h = module(shifted, h, cos, sin)
            logits = head(module.norm(h[:, :T - k]))                         # positions with a target only
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets[:, k:].flatten()))
        return self.factor * torch.stack(losses).mean()

    def take_aux(self, micro_batches: int) -> torch.Tensor:
        """Sum of the MTP losses of the step's last `micro_batches` backward passes; resets."""
        taken, self.aux_trained = self.aux_trained[-micro_batches:], []
        return torch.stack(taken).sum() if taken else torch.zeros(())
