"""LLaMA, Qwen3(-MoE) and DeepSeek-V3-class models in MindSpore, parameter for parameter the
torch backend's (Hugging Face names): grouped-query or multi-latent attention (mla.py), dense or
MoE feed-forward (moe.py), optional multi-token prediction modules (mtp.py).

Every computation is a Primitive held as an attribute (self.matmul, self.softmax, ...), so
the lowering (lower.py) can give each one a shard strategy from the ModelPlan: the model
itself carries no sharding. Linear layers flatten their input to 2-D (B*T, in) and keep
the weight [out, in] with transpose_b, as MindFormers does, so the op-level strategies
are MindFormers' own. Attention is BatchMatMul + softmax, which runs everywhere; with
`model.flash_attention` on an Ascend target it is FlashAttentionScore (BNSD, MindFormers'
causal uint8 mask; no mask as ring attention), which has no CPU kernel. Both paths hold the same parameters.
Multi-latent attention always takes the BatchMatMul path.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from ms_llm.config.model import ModelConfig
from ms_llm.init import init_param
from ms_llm.mindspore.layers import MLP, Linear, RMSNorm, Rotary
from ms_llm.mindspore.mla import MLAttention
from ms_llm.mindspore.moe import MoE
from ms_llm.mindspore.mtp import MTPModule
from ms_llm.rope import inv_frequencies

MASK_VALUE = -1e4     # additive causal mask (MindFormers' value): exp() is exactly 0 in fp32, and fp16 holds it
FLASH_TARGETS = ("Ascend",)    # device targets with a FlashAttentionScore kernel


def uses_flash_attention(cfg: ModelConfig) -> bool:
    """Flash attention when the config asks for it and the device target has the kernel; elsewhere
    (CPU) the BatchMatMul path computes the same attention, so a config runs on both. Not under
    MLA, whose keys and values differ in width."""
    return cfg.flash_attention and cfg.mla is None and ms.get_context("device_target") in FLASH_TARGETS


class Embedding(nn.Cell):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((vocab, dim), np.float32)), name="weight")
        self.gather = ops.Gather()

    def construct(self, tokens):
        return self.gather(self.weight, tokens, 0)     # (B, T) -> (B, T, H)


def rotary_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (max_seq_len, head_dim), HF layout (frequencies repeated twice), fp32 as torch computes them,
    scaled by the rope scaling's attention factor (YaRN)."""
    inv_freq, attention_factor = inv_frequencies(cfg)
    t = np.arange(cfg.max_seq_len, dtype=np.int64).astype(np.float32)
    freqs = np.outer(t, inv_freq).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return ((np.cos(emb) * np.float32(attention_factor)).astype(np.float32),
            (np.sin(emb) * np.float32(attention_factor)).astype(np.float32))


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
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg)
        self.add = ops.Add()
        self.no_aux = Tensor(0.0, ms.float32)

    def construct(self, x, cos, sin, mask):
        return self.with_aux(x, cos, sin, mask)[0]

    def with_aux(self, x, cos, sin, mask):
        """(output, this layer's MoE router losses; 0 for a dense layer)."""
        if self.is_moe:
            return self.routed(x, cos, sin, mask)[:2]
        x = self.add(x, self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return self.add(x, self.mlp(self.post_attention_layernorm(x))), self.no_aux

    def routed(self, x, cos, sin, mask):
        """An MoE layer's (output, router losses, token copies routed to each expert (E,))."""
        x = self.add(x, self.self_attn(self.input_layernorm(x), cos, sin, mask))
        y, aux, load = self.mlp.route(self.post_attention_layernorm(x))
        return self.add(x, y), aux, load


class Backbone(nn.Cell):
    """HF's `model.` prefix: embeddings, layers, final norm (and the MTP modules, model.mtp.{d})."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.CellList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if cfg.mtp_layers:
            self.mtp = nn.CellList([MTPModule(cfg, d + 1, DecoderLayer(cfg, cfg.num_layers + d))
                                    for d in range(cfg.mtp_layers)])


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
        self.mtp_layers = cfg.mtp_layers
        self.track_loads = cfg.moe is not None and cfg.moe.expert_bias
        if self.track_loads:
            self.stack_loads = ops.Stack()
        self.use_flash = uses_flash_attention(cfg)
        if cfg.flash_attention and cfg.mla is None:
            # MindFormers' flash mask: (B, 1, T, T) uint8, 1 above the diagonal; tiled over the batch
            # so its batch dim splits like the queries'.
            causal = np.triu(np.ones((cfg.max_seq_len, cfg.max_seq_len), np.uint8), 1)
            self.flash_mask = Tensor(causal[None, None])
            self.mask_tile = ops.Tile()

    def construct(self, tokens):
        return self.with_aux(tokens)[0]

    def with_aux(self, tokens):
        """(logits, the MoE layers' router losses summed, MTP layers' included)."""
        logits, aux, _, _ = self.outputs(tokens)
        return logits, aux

    def outputs(self, tokens):
        """(logits (B, T, V), router losses summed, expert loads (moe layers with an expert bias,
        main then MTP, E) fp32 (0 without), MTP logits: one (B, T, V) per depth)."""
        b, t = tokens.shape
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        if self.use_flash and self.ring_attention:
            mask = None
        elif self.use_flash:
            mask = self.mask_tile(self.flash_mask[:, :, :t, :t], (b, 1, 1, 1))
        else:
            mask = self.mask[:t, :t]
        embedded = self.model.embed_tokens(tokens)
        x, aux, loads = embedded, self.no_aux, ()
        for layer in self.model.layers:
            x, aux, loads = self._layer(layer, x, aux, loads, cos, sin, mask)
        hidden = self.model.norm(x)                   # h_0 of the MTP modules
        logits, mtp_logits = self.lm_head(hidden), ()
        if self.mtp_layers:
            for module in self.model.mtp:             # depth k: from h_{k-1} and the embedding of token i + k
                hidden, aux, loads = self._layer(module.layer, module(embedded, hidden), aux, loads, cos, sin, mask)
                mtp_logits = mtp_logits + (self.lm_head(module.norm(hidden)),)
        loads = self.stack_loads(loads) if self.track_loads else self.no_aux
        return logits, aux, loads, mtp_logits

    def _layer(self, layer, x, aux, loads, cos, sin, mask):
        """One decoder layer, its router losses added to `aux` and its loads to `loads`. Dense layers
        are called as cells: the shared ZeRO-3 engine gathers a layer's parameters in the cell's
        forward hook, which a method call would skip."""
        if layer.is_moe:
            x, layer_aux, load = layer.routed(x, cos, sin, mask)
            if self.track_loads:
                loads = loads + (load,)
            return x, aux + layer_aux, loads
        return layer(x, cos, sin, mask), aux, loads

    def expert_biases(self) -> list[Parameter]:
        """The MoE layers' e_score_correction_bias, main layers then MTP modules: the rows of the
        loads `outputs` returns."""
        layers = list(self.model.layers) + ([m.layer for m in self.model.mtp] if self.mtp_layers else [])
        return [layer.mlp.gate.e_score_correction_bias for layer in layers if layer.is_moe] if self.track_loads else []

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Same values as the torch backend for the same seed (ms_llm.init); the expert biases
        (not trained) start at 0."""
        for name, p in self.parameters_and_names():
            value = init_param(name, tuple(p.shape), seed, std) if p.requires_grad else np.zeros(p.shape, np.float32)
            p.set_data(Tensor(value))

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
    (their gradient reaches the routers through this sum, scaled with the loss) and the MTP loss,
    so the loss reported is torch's TrainStep's; validation (training False) is cross-entropy
    alone, as torch's evaluate. With loads, (loss, the expert loads of Transformer.outputs): the
    training step sums them over its micro-batches for the expert-bias update."""

    def __init__(self, net: Transformer, training: bool = True, loads: bool = False):
        super().__init__(auto_prefix=False)      # keep the HF parameter names
        self.net, self.with_losses, self.with_loads = net, training, loads
        self.mtp_layers, self.mtp_factor = net.cfg.mtp_layers, net.cfg.mtp_loss_factor
        self.loss = CrossEntropy()
        self.reshape = ops.Reshape()

    def construct(self, inputs, labels):
        logits, aux, loads, mtp_logits = self.net.outputs(inputs)
        loss = self.loss(self.reshape(logits, (-1, logits.shape[-1])), self.reshape(labels, (-1,)))
        if self.with_losses:
            loss = loss + aux
            if self.mtp_layers:
                loss = loss + self.mtp_loss(mtp_logits, labels)
        if self.with_loads:
            return loss, loads
        return loss

    def mtp_loss(self, mtp_logits, labels):
        """mtp_loss_factor x the mean over depths k of the cross-entropy of logits_k[:, i] against
        labels[:, i + k] (token i + 1 + k), over the T - k positions that have one (a depth
        without any, k >= T, adds 0)."""
        t, total = labels.shape[1], self.net.no_aux
        for k, logits in enumerate(mtp_logits, 1):
            if k < t:
                total = total + self.loss(self.reshape(logits[:, :t - k], (-1, logits.shape[-1])),
                                          self.reshape(labels[:, k:], (-1,)))
        return total * (self.mtp_factor / self.mtp_layers)
