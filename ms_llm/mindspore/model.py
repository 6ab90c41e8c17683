"""LLaMA in MindSpore, parameter for parameter the torch backend's (Hugging Face names).

Every computation is a Primitive held as an attribute (self.matmul, self.softmax, ...), so
the lowering (lower.py) can give each one a shard strategy from the ModelPlan: the model
itself carries no sharding. Linear layers flatten their input to 2-D (B*T, in) and keep
the weight [out, in] with transpose_b, as MindFormers does, so the op-level strategies
are MindFormers' own. Attention is BatchMatMul + softmax, which runs everywhere; with
`model.flash_attention` on an Ascend target it is FlashAttentionScore (BNSD, MindFormers'
causal uint8 mask; no mask as ring attention), which has no CPU kernel. Both paths hold the same parameters.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from ms_llm.config.model import ModelConfig
from ms_llm.init import init_param
from ms_llm.mindspore.layers import MLP, Linear
from ms_llm.mindspore.moe import MoE
from ms_llm.rope import inv_frequencies

MASK_VALUE = -1e4     # additive causal mask (MindFormers' value): exp() is exactly 0 in fp32, and fp16 holds it
FLASH_TARGETS = ("Ascend",)    # device targets with a FlashAttentionScore kernel


def uses_flash_attention(cfg: ModelConfig) -> bool:
    """Flash attention when the config asks for it and the device target has the kernel; elsewhere
    (CPU) the BatchMatMul path computes the same attention, so a config runs on both."""
    return cfg.flash_attention and ms.get_context("device_target") in FLASH_TARGETS


class Embedding(nn.Cell):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((vocab, dim), np.float32)), name="weight")
        self.gather = ops.Gather()

    def construct(self, tokens):
        return self.gather(self.weight, tokens, 0)     # (B, T) -> (B, T, H)


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


def rotary_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (max_seq_len, head_dim), HF layout (frequencies repeated twice), fp32 as torch computes them,
    scaled by the rope scaling's attention factor (YaRN)."""
    inv_freq, attention_factor = inv_frequencies(cfg)
    t = np.arange(cfg.max_seq_len, dtype=np.int64).astype(np.float32)
    freqs = np.outer(t, inv_freq).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return ((np.cos(emb) * np.float32(attention_factor)).astype(np.float32),
            (np.sin(emb) * np.float32(attention_factor)).astype(np.float32))


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


class Attention(nn.Cell):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rep = cfg.num_heads // cfg.num_kv_heads
        self.q_proj = Linear(cfg.hidden_size, cfg.q_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.kv_dim, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.kv_dim, cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_dim, cfg.hidden_size)
        # Qwen3: RMSNorm over each head's features, shared by all heads (replicated under tp).
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.rotary = Rotary()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()              # (B, T, nh, hs) -> (B, nh, T, hs)
        self.merge_heads = ops.Transpose()            # (B, nh, T, hs) -> (B, T, nh, hs)
        self.tile_kv = ops.Tile()
        self.batch_matmul_q_k = ops.BatchMatMul(transpose_b=True)
        self.batch_matmul = ops.BatchMatMul()
        self.mul = ops.Mul()
        self.add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.scale = Tensor(1.0 / float(np.sqrt(cfg.head_dim)), ms.float32)
        self.use_flash = uses_flash_attention(cfg)
        if cfg.flash_attention:
            # Built whenever asked for, so its shard strategy is set (and checked) on every target.
            # next_tokens=0 with the causal mask: MindFormers' settings. GQA needs no tiled k/v.
            self.flash_attention = FlashAttentionScore(head_num=cfg.num_heads, scale_value=float(self.scale),
                                                       pre_tokens=2147483647, next_tokens=0, input_layout="BNSD")
            self.flash_dtype = ms.float16 if cfg.dtype == "float16" else ms.bfloat16   # the kernel's dtypes

    def _heads(self, x, n, norm=None):
        b, t, _ = x.shape
        x = self.reshape(x, (b, t, n, self.head_dim))                                 # (B, T, n, hs)
        if norm is not None:
            x = norm(x)
        return self.transpose(x, (0, 2, 1, 3))

    def _repeat_kv(self, x):
        # GQA: kv head j serves query heads j*rep .. j*rep+rep-1 (torch's repeat_interleave)
        if self.rep == 1:
            return x
        b, n, t, d = x.shape
        x = self.tile_kv(self.reshape(x, (b, n, 1, t * d)), (1, 1, self.rep, 1))
        return self.reshape(x, (b, n * self.rep, t, d))

    def _flash(self, q, k, v, mask):
        """FlashAttentionScore on (B, nh, T, hs) q and (B, nkv, T, hs) k/v; mask (B, 1, T, T) uint8, 1 = hidden."""
        dtype = q.dtype
        cast = (ops.cast(q, self.flash_dtype), ops.cast(k, self.flash_dtype), ops.cast(v, self.flash_dtype))
        _, _, _, y = self.flash_attention(*cast, None, None, None, mask)
        return ops.cast(y, dtype)

    def construct(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q = self.rotary(self._heads(self.q_proj(x), self.num_heads, q_norm), cos, sin)       # (B, nh, T, hs)
        k = self.rotary(self._heads(self.k_proj(x), self.num_kv_heads, k_norm), cos, sin)    # (B, nkv, T, hs)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if self.use_flash:
            y = self._flash(q, k, v, mask)                                            # (B, nh, T, hs)
        else:
            k, v = self._repeat_kv(k), self._repeat_kv(v)
            score = self.add(mask, self.mul(self.batch_matmul_q_k(q, k), self.scale))    # (B, nh, T, T)
            y = self.batch_matmul(self.softmax(score), v)                                 # (B, nh, T, hs)
        y = self.reshape(self.merge_heads(y, (0, 2, 1, 3)), (b, t, self.num_heads * self.head_dim))
        return self.o_proj(y)


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg)
        self.add = ops.Add()
        self.no_aux = Tensor(0.0, ms.float32)

    def construct(self, x, cos, sin, mask):
        return self.with_aux(x, cos, sin, mask)[0]

    def with_aux(self, x, cos, sin, mask):
        """(output, this layer's MoE router losses; 0 for a dense layer)."""
        x = self.add(x, self.self_attn(self.input_layernorm(x), cos, sin, mask))
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            y, aux = self.mlp.route(h)
            return self.add(x, y), aux
        return self.add(x, self.mlp(h)), self.no_aux


class Backbone(nn.Cell):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.CellList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class Transformer(nn.Cell):
    """Tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig, ring_attention: bool = False):
        """ring_attention: flash attention is called without a mask, as ring attention is (the
        lowering's enable_ring_attention: MindSpore's parallel pass masks each ring step itself)."""
        super().__init__()
        self.cfg = cfg
        self.ring_attention = ring_attention
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_tables(cfg)
        self.rope_cos, self.rope_sin = Tensor(cos), Tensor(sin)
        self.mask = Tensor(np.triu(np.full((cfg.max_seq_len, cfg.max_seq_len), MASK_VALUE, np.float32), 1))
        self.no_aux = Tensor(0.0, ms.float32)
        self.use_flash = uses_flash_attention(cfg)
        if cfg.flash_attention:
            # MindFormers' flash mask: (B, 1, T, T) uint8, 1 above the diagonal; tiled over the batch
            # so its batch dim splits like the queries'.
            causal = np.triu(np.ones((cfg.max_seq_len, cfg.max_seq_len), np.uint8), 1)
            self.flash_mask = Tensor(causal[None, None])
            self.mask_tile = ops.Tile()

    def construct(self, tokens):
        return self.with_aux(tokens)[0]

    def with_aux(self, tokens):
        """(logits, the MoE layers' router losses summed)."""
        b, t = tokens.shape
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        if self.use_flash and self.ring_attention:
            mask = None
        elif self.use_flash:
            mask = self.mask_tile(self.flash_mask[:, :, :t, :t], (b, 1, 1, 1))
        else:
            mask = self.mask[:t, :t]
        x, aux = self.model.embed_tokens(tokens), self.no_aux
        for layer in self.model.layers:
            # Dense layers are called as cells: the shared ZeRO-3 engine gathers a layer's
            # parameters in the cell's forward hook, which a method call would skip.
            if layer.is_moe:
                x, layer_aux = layer.with_aux(x, cos, sin, mask)
                aux = aux + layer_aux
            else:
                x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x)), aux

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Same values as the torch backend for the same seed (ms_llm.init)."""
        for name, p in self.parameters_and_names():
            p.set_data(Tensor(init_param(name, tuple(p.shape), seed, std)))

    def load_numpy(self, state: dict[str, np.ndarray]) -> None:
        """Set every parameter from a {HF name: array} mapping (e.g. a torch state dict)."""
        for name, p in self.parameters_and_names():
            if name not in state:
                raise KeyError(f"{name}: missing from the state being loaded")
            p.set_data(Tensor(np.ascontiguousarray(state[name], dtype=np.float32)))


class CrossEntropy(nn.Cell):
    """Mean next-token loss over (N, V) logits, as MindFormers decomposes it (each op shardable)."""

    def __init__(self):
        super().__init__()
        self.max = ops.ReduceMax(keep_dims=True)
        self.sub = ops.Sub()
        self.exp = ops.Exp()
        self.sum = ops.ReduceSum(keep_dims=True)
        self.log = ops.Log()
        self.sub2 = ops.Sub()
        self.onehot = ops.OneHot()
        self.mul = ops.Mul()
        self.neg = ops.Neg()
        self.sum2 = ops.ReduceSum()
        self.mean = ops.ReduceMean()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, logits, labels):
        shifted = self.sub(logits, ops.stop_gradient(self.max(logits, -1)))
        log_probs = self.sub2(shifted, self.log(self.sum(self.exp(shifted), -1)))
        onehot = self.onehot(labels, logits.shape[-1], self.on, self.off)
        return self.mean(self.sum2(self.neg(self.mul(log_probs, onehot)), -1))


class LossCell(nn.Cell):
    """(inputs, labels) (B, T) -> mean token cross-entropy, plus in training the MoE router losses
    (their gradient reaches the routers through this sum, scaled with the loss), so the loss
    reported is torch's TrainStep's; validation (router_losses False) is cross-entropy alone, as
    torch's evaluate."""

    def __init__(self, net: Transformer, router_losses: bool = True):
        super().__init__(auto_prefix=False)      # keep the HF parameter names
        self.net, self.router_losses = net, router_losses
        self.loss = CrossEntropy()
        self.reshape = ops.Reshape()

    def construct(self, inputs, labels):
        logits, aux = self.net.with_aux(inputs)
        v = logits.shape[-1]
        loss = self.loss(self.reshape(logits, (-1, v)), self.reshape(labels, (-1,)))
        return loss + aux if self.router_losses else loss
