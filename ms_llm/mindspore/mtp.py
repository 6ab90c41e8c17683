"""Multi-token prediction (DeepSeek-V3 sec. 2.2, eq. 21-25) in MindSpore: the spec's modules
`model.mtp.{d}` (enorm, hnorm, eh_proj, layer, norm), d = 0 .. mtp_layers - 1.

Depth k = d + 1 sees the embedding of token i + k (0 past the sequence's end) beside the previous
depth's hidden state h_{k-1} (h_0: the main model's output after model.norm):
h'_k = eh_proj(cat[enorm(e_k), hnorm(h_{k-1})]), embedding first as Megatron-core and DeepSeek's
checkpoint lay eh_proj out. The decoder layer, the final norm and the shared lm_head are applied
by model.Transformer, which owns the rotary tables, the mask and the router losses; the loss is
model.LossCell's (mtp_loss).
"""
from __future__ import annotations

from mindspore import nn, ops

from ms_llm.config.model import ModelConfig
from ms_llm.mindspore.layers import Linear, RMSNorm


class MTPModule(nn.Cell):
    """One depth: its norms, its projection of [embedding, hidden] back to H, and its decoder layer
    (built by the caller: model.DecoderLayer(cfg, num_layers + d), MoE by is_moe_layer)."""

    def __init__(self, cfg: ModelConfig, depth: int, layer: nn.Cell):
        super().__init__()
        h = cfg.hidden_size
        self.depth = depth                             # k: predicts token i + 1 + k at position i
        self.enorm = RMSNorm(h, cfg.norm_eps)
        self.hnorm = RMSNorm(h, cfg.norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.layer = layer
        self.norm = RMSNorm(h, cfg.norm_eps)
        self.concat_shift = ops.Concat(axis=1)
        self.concat = ops.Concat(axis=-1)

    def construct(self, embedded, hidden):
        """embedded (B, T, H): the main model's token embeddings; hidden (B, T, H): h_{k-1}. Returns
        h'_k, the decoder layer's input."""
        b, t, h = embedded.shape
        k = self.depth
        if k < t:
            shifted = self.concat_shift((embedded[:, k:], ops.zeros((b, k, h), embedded.dtype)))
        else:
            shifted = ops.zeros((b, t, h), embedded.dtype)
        return self.eh_proj(self.concat((self.enorm(shifted), self.hnorm(hidden))))
