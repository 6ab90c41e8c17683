"""Multi-latent attention (DeepSeek-V2/V3) in MindSpore, parameter for parameter transformers'
DeepseekV3Attention (the spec's names, so ms_llm.init gives both backends the same values).

Queries come from the hidden state through q_proj, or through the low-rank path q_a_proj ->
q_a_layernorm -> q_b_proj; keys and values from one compressed latent (kv_a_proj_with_mqa ->
kv_a_layernorm -> kv_b_proj) plus a rotary key of qk_rope_head_dim that every head shares. Each
head attends over qk_nope_head_dim + qk_rope_head_dim and returns v_head_dim. With
rope_interleave the rotary pairs are (x0, x1), (x2, x3)... (DeepSeek's checkpoint layout): they
are de-interleaved first, evens then odds, after which the usual rotate_half rotation is the
same arithmetic as transformers' apply_rotary_pos_emb_interleave. As in model.py, every
computation is a Primitive attribute and attention is BatchMatMul + softmax (the fused kernel
takes one head width for q, k and v, which MLA does not have).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_llm.config.model import ModelConfig
from ms_llm.mindspore.layers import Linear, RMSNorm, Rotary
from ms_llm.rope import yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times m(mscale_all_dim)^2 under YaRN with mscale_all_dim set (transformers'
    yarn_apply_mscale: the attention temperature the rotary tables leave out)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    r = cfg.rope_scaling
    if r.type == "yarn" and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


class DecoupledRotary(nn.Cell):
    """Rotary on the rope part (B, heads, T, d); with rope_interleave its pairs (x0, x1), (x2, x3)...
    are first laid out as (x0, x2, ..., x1, x3, ...), rotate_half's halves."""

    def __init__(self, interleave: bool):
        super().__init__()
        self.interleave = interleave
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.rotary = Rotary()

    def construct(self, x, cos, sin):
        if self.interleave:
            b, n, t, d = x.shape
            pairs = self.reshape(x, (b, n, t, d // 2, 2))
            x = self.reshape(self.transpose(pairs, (0, 1, 2, 4, 3)), (b, n, t, d))
        return self.rotary(x, cos, sin)


class MLAttention(nn.Cell):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, h = cfg.mla, cfg.hidden_size
        self.num_heads, self.nope, self.rope, self.v_dim = cfg.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, \
            a.v_head_dim
        self.qk_dim, self.kv_rank = a.qk_head_dim, a.kv_lora_rank
        self.low_rank_q = a.q_lora_rank is not None
        if self.low_rank_q:
            self.q_a_proj = Linear(h, a.q_lora_rank)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = Linear(a.q_lora_rank, cfg.q_dim)
        else:
            self.q_proj = Linear(h, cfg.q_dim)
        self.kv_a_proj_with_mqa = Linear(h, a.kv_lora_rank + a.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = Linear(a.kv_lora_rank, cfg.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
        self.o_proj = Linear(cfg.attn_out_dim, h)
        self.rotary_q = DecoupledRotary(a.rope_interleave)
        self.rotary_k = DecoupledRotary(a.rope_interleave)
        self.reshape = ops.Reshape()
        self.transpose_q = ops.Transpose()            # (B, T, nh, d) -> (B, nh, T, d)
        self.transpose_kv = ops.Transpose()
        self.merge_heads = ops.Transpose()            # (B, nh, T, v) -> (B, T, nh, v)
        self.slice = ops.StridedSlice()               # q's and kv's columns per head (B, nh, T, d)
        self.slice_latent = ops.StridedSlice()        # the latent's (B, T, kv + rope): one strategy a primitive
        self.tile_k = ops.Tile()                      # the shared rotary key, to every head
        self.concat_q = ops.Concat(axis=-1)
        self.concat_k = ops.Concat(axis=-1)
        self.batch_matmul_q_k = ops.BatchMatMul(transpose_b=True)
        self.batch_matmul = ops.BatchMatMul()
        self.mul = ops.Mul()
        self.add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.scale = Tensor(softmax_scale(cfg), ms.float32)

    @staticmethod
    def _cols(slice_op, x, start: int, stop: int):
        """x[..., start:stop]."""
        shape = x.shape
        return slice_op(x, (0,) * (len(shape) - 1) + (start,), shape[:-1] + (stop,), (1,) * len(shape))

    def construct(self, x, cos, sin, mask):
        b, t, _ = x.shape
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q = self.transpose_q(self.reshape(q, (b, t, nh, self.qk_dim)), (0, 2, 1, 3))      # (B, nh, T, qk)
        q_rot = self.rotary_q(self._cols(self.slice, q, self.nope, self.qk_dim), cos, sin)
        q = self.concat_q((self._cols(self.slice, q, 0, self.nope), q_rot))

        latent = self.kv_a_proj_with_mqa(x)                                                # (B, T, kv + rope)
        kv = self.kv_b_proj(self.kv_a_layernorm(self._cols(self.slice_latent, latent, 0, self.kv_rank)))
        kv = self.transpose_kv(self.reshape(kv, (b, t, nh, self.nope + self.v_dim)), (0, 2, 1, 3))
        k_rot = self.reshape(self._cols(self.slice_latent, latent, self.kv_rank, self.kv_rank + self.rope),
                             (b, 1, t, self.rope))
        k_rot = self.rotary_k(k_rot, cos, sin)
        k = self.concat_k((self._cols(self.slice, kv, 0, self.nope), self.tile_k(k_rot, (1, nh, 1, 1))))
        v = self._cols(self.slice, kv, self.nope, self.nope + self.v_dim)                  # (B, nh, T, v)

        score = self.add(mask, self.mul(self.batch_matmul_q_k(q, k), self.scale))          # (B, nh, T, T)
        y = self.batch_matmul(self.softmax(score), v)                                      # (B, nh, T, v)
        y = self.reshape(self.merge_heads(y, (0, 2, 1, 3)), (b, t, nh * self.v_dim))
        return self.o_proj(y)
