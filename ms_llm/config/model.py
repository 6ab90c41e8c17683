"""ModelConfig: the shape of a decoder LLM (LLaMA / Qwen attention or DeepSeek's multi-latent attention;
dense, Mixtral, DeepSeekMoE or Qwen3-MoE feed-forward; optional multi-token prediction). Sizes only;
no parallelism here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from ms_llm.config.schema import spec
from ms_llm.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rotary frequency scaling, as transformers' rope_parameters names it (modeling_rope_utils)."""
    type: RopeType = spec("default", "default: plain RoPE; linear: frequencies / factor; dynamic: NTK, equal to "
                                     "default for positions below max_seq_len (all the model holds); llama3: "
                                     "Llama-3.1's banded scaling; yarn: YaRN ramp plus cos/sin attention factor.")
    factor: float = spec(1.0, "Context extension factor (linear, dynamic, llama3, yarn).", ge=1.0, le=1e6)
    low_freq_factor: float = spec(1.0, "llama3: wavelengths above original/low_freq_factor are divided by factor.",
                                  ge=1e-6, le=1e6)
    high_freq_factor: float = spec(4.0, "llama3: wavelengths below original/high_freq_factor are kept.",
                                   ge=1e-6, le=1e6)
    original_max_seq_len: Optional[int] = spec(None, "Pretraining context (llama3, yarn: "
                                                     "original_max_position_embeddings).", ge=1, le=1 << 24)
    beta_fast: float = spec(32.0, "yarn: rotations where the ramp ends (pure extrapolation above).", ge=1e-6, le=1e6)
    beta_slow: float = spec(1.0, "yarn: rotations where the ramp starts (pure interpolation below).", ge=1e-6, le=1e6)
    attention_factor: Optional[float] = spec(None, "yarn: cos/sin scale; null = 0.1 ln(factor) + 1, or from mscale "
                                                   "and mscale_all_dim when set.", ge=0.0, le=1e6)
    mscale: Optional[float] = spec(None, "yarn (DeepSeek): cos/sin scale = m(mscale) / m(mscale_all_dim), with "
                                         "m(x) = 0.1 x ln(factor) + 1.", ge=0.0, le=1e6)
    mscale_all_dim: Optional[float] = spec(None, "yarn (DeepSeek): also scales the softmax of multi-latent "
                                                 "attention by m(mscale_all_dim)^2.", ge=0.0, le=1e6)
    truncate: bool = spec(True, "yarn: round the ramp bounds to whole dims.")

    def __post_init__(self) -> None:
        if self.type in ("dynamic", "llama3", "yarn") and self.original_max_seq_len is None:
            raise ConfigError(f"model.rope_scaling.original_max_seq_len: required by type {self.type!r}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"model.rope_scaling.high_freq_factor: {self.high_freq_factor} must exceed "
                              f"low_freq_factor={self.low_freq_factor}")


# Upper bounds well past any published model (GPT-3: 96 layers x 12288 wide, Llama 3 405B: 126 x 16384,
# 128k vocab): they exist so a typo such as 1e308 is refused by name instead of overflowing a size.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 16
MAX_SEQ = 1 << 24
MAX_PARAMS = 10 ** 15            # checked on the derived total: 1000x the largest dense models


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2/V3), transformers' DeepseekV3Attention: q through a low-rank
    path (q_a_proj, q_a_layernorm, q_b_proj) or q_proj; keys and values from one compressed latent
    (kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj) plus a rotary key of qk_rope_head_dim shared
    by every head. Each head attends over qk_nope_head_dim + qk_rope_head_dim and returns v_head_dim."""
    q_lora_rank: Optional[int] = spec(None, "Rank of the query's low-rank path (DeepSeek-V3: 1536); null = "
                                            "q_proj straight from the hidden state (DeepSeek-V2-Lite).",
                                      ge=1, le=MAX_WIDTH)
    kv_lora_rank: int = spec(512, "Width of the compressed key/value latent.", ge=1, le=MAX_WIDTH)
    qk_nope_head_dim: int = spec(128, "Per-head query/key width without rotary.", ge=1, le=MAX_WIDTH)
    qk_rope_head_dim: int = spec(64, "Per-head query width with rotary; the rotary key of this width is "
                                     "shared by all heads.", ge=2, le=MAX_WIDTH)
    v_head_dim: int = spec(128, "Per-head value width (o_proj takes num_heads x v_head_dim).", ge=1, le=MAX_WIDTH)
    rope_interleave: bool = spec(True, "Rotary pairs interleaved (x0, x1), (x2, x3)... as DeepSeek's checkpoints "
                                       "lay them out (transformers' rope_interleave); false = rotate_half halves.")

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim: {self.qk_rope_head_dim} must be even (rotary pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


ScoreFunction = Literal["softmax", "sigmoid"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sparse mixture-of-experts feed-forward (Mixtral, DeepSeekMoE, Qwen3-MoE): a router scores the
    num_experts SwiGLU experts per token (softmax or sigmoid), picks top_k (optionally from the best
    num_groups / group_top_k groups only, and with an expert bias that steers selection only), and
    weights their outputs; optional always-on shared experts run beside them."""
    num_experts: int = spec(doc="Routed experts per MoE layer.", ge=1, le=MAX_HEADS)
    top_k: int = spec(2, "Experts each token is routed to.", ge=1, le=MAX_HEADS)
    expert_ffn_hidden_size: int = spec(-1, "SwiGLU inner width of one expert; -1 = model.ffn_hidden_size "
                                           "(Mixtral), smaller for fine-grained experts (DeepSeek).",
                                       ge=-1, le=MAX_WIDTH)
    shared_experts: int = spec(0, "Always-on experts beside the routed ones, run as one SwiGLU MLP of "
                                  "shared_experts x expert width (DeepSeek); 0 = none.", ge=0, le=MAX_HEADS)
    normalize_top_k: bool = spec(True, "Renormalise the top_k routing weights to sum to 1 (Mixtral); false "
                                       "keeps the raw softmax probabilities (DeepSeek-V2, Qwen2-MoE).")
    capacity_factor: float = spec(-1.0, "Tokens an expert takes per step = capacity_factor x tokens x top_k / "
                                        "num_experts, the rest dropped (GShard); -1 = dropless.",
                                  ge=-1.0, le=1024.0)
    use_gmm: bool = spec(False, "MindSpore on Ascend: dropless dispatch by sorting the token copies by expert and "
                                "running the experts as GroupedMatmul (MindFormers' moe_config.use_gmm, MoEV3) instead "
                                "of worst-case capacity; needs capacity_factor -1. Ignored by the torch backend.")
    aux_loss_coeff: float = spec(0.01, "Load-balancing loss weight (Switch: num_experts x sum_e f_e P_e, "
                                       "1.0 when balanced), per MoE layer.", ge=0.0, le=1e3)
    z_loss_coeff: float = spec(0.0, "Router z-loss weight (ST-MoE: mean logsumexp(router logits)^2).",
                               ge=0.0, le=1e3)
    layer_freq: int = spec(1, "Every layer_freq-th layer (index % layer_freq == 0) is MoE; 1 = all.",
                           ge=1, le=MAX_LAYERS)
    first_dense_layers: int = spec(0, "Leading layers that stay dense (DeepSeek's first_k_dense_replace).",
                                   ge=0, le=MAX_LAYERS)
    dense_layers: tuple[int, ...] = spec((), "Further layer indices that stay dense (Qwen3-MoE's mlp_only_layers).")
    score_function: ScoreFunction = spec("softmax", "Router scores: softmax over the experts (Mixtral, Qwen3-MoE, "
                                                    "DeepSeek-V2) or a sigmoid per expert (DeepSeek-V3).")
    routed_scaling_factor: float = spec(1.0, "Multiplies the routed experts' weights after any renormalisation "
                                             "(DeepSeek-V3: 2.5).", ge=0.0, le=1e3)
    num_groups: int = spec(1, "Expert groups for group-limited routing (DeepSeek-V3's n_group: 8); 1 = off.",
                           ge=1, le=MAX_HEADS)
    group_top_k: int = spec(1, "Groups a token may route into (topk_group: 4); a group scores the sum of its "
                               "best top_k / group_top_k expert scores (Megatron, DeepSeek-V3).", ge=1, le=MAX_HEADS)
    expert_bias: bool = spec(False, "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores "
                                    "for selection only, moved by bias_update_rate x sign(mean load - load) after "
                                    "every optimizer step; checkpointed, equal on every rank.")
    bias_update_rate: float = spec(1e-3, "Step of the expert bias update (DeepSeek-V3: 1e-3; MindFormers: 1e-4).",
                                   ge=0.0, le=1e3)
    seq_aux_loss_coeff: float = spec(0.0, "Sequence-wise balance loss weight (DeepSeek-V3: 1e-4): the top-k "
                                          "load-balancing loss taken per sequence and averaged.", ge=0.0, le=1e3)

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.moe.top_k: {self.top_k} exceeds model.moe.num_experts={self.num_experts}")
        if self.expert_ffn_hidden_size == 0:
            raise ConfigError("model.moe.expert_ffn_hidden_size: got 0; use a width >= 1, or -1 for "
                              "model.ffn_hidden_size")
        if self.capacity_factor != -1.0 and self.capacity_factor <= 0:
            raise ConfigError(f"model.moe.capacity_factor: got {self.capacity_factor}; use a positive factor, "
                              "or -1 for a dropless router")
        if self.use_gmm and self.capacity_factor != -1.0:
            raise ConfigError(f"model.moe.use_gmm: the GroupedMatmul path is dropless, capacity_factor "
                              f"{self.capacity_factor} would be ignored; set capacity_factor -1 or use_gmm false")
        if self.num_experts % self.num_groups:
            raise ConfigError(f"model.moe.num_groups: {self.num_groups} must divide model.moe.num_experts="
                              f"{self.num_experts}")
        if self.group_top_k > self.num_groups:
            raise ConfigError(f"model.moe.group_top_k: {self.group_top_k} exceeds model.moe.num_groups="
                              f"{self.num_groups}")
        if self.num_groups > 1 and self.top_k % self.group_top_k:
            raise ConfigError(f"model.moe.group_top_k: {self.group_top_k} must divide model.moe.top_k={self.top_k} "
                              "(each chosen group scores its best top_k / group_top_k experts)")
        if self.top_k > self.group_top_k * (self.num_experts // self.num_groups):
            raise ConfigError(f"model.moe.top_k: {self.top_k} exceeds the {self.group_top_k} x "
                              f"{self.num_experts // self.num_groups} experts of the groups a token may use")
        if any(i < 0 for i in self.dense_layers):
            raise ConfigError(f"model.moe.dense_layers: {list(self.dense_layers)} holds a negative layer index")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = spec("model", "Flavor name, used in run folders and tables.")
    vocab_size: int = spec(doc="Embedding rows and lm_head outputs.", ge=2, le=1 << 24)
    hidden_size: int = spec(doc="Model width d_model.", ge=1, le=MAX_WIDTH)
    num_layers: int = spec(doc="Decoder layers.", ge=1, le=MAX_LAYERS)
    num_heads: int = spec(doc="Query heads.", ge=1, le=MAX_HEADS)
    num_kv_heads: Optional[int] = spec(None, "Key/value heads (GQA); null or left out = num_heads (plain "
                                             "multi-head).", ge=1, le=MAX_HEADS)
    ffn_hidden_size: int = spec(doc="SwiGLU inner width (gate_proj/up_proj outputs).", ge=1, le=MAX_WIDTH)
    max_seq_len: int = spec(2048, "Longest sequence the rotary tables are built for.", ge=1, le=MAX_SEQ)
    rope_theta: float = spec(10000.0, "Rotary base frequency.", ge=1.0, le=1e12)
    rope_scaling: RopeScaling = spec(doc="Rotary frequency scaling (Llama-3.1, YaRN, ...).",
                                     default_factory=RopeScaling)
    head_dim: Optional[int] = spec(None, "Per-head width; null or left out = hidden_size / num_heads (Qwen3 sets "
                                         "it apart: 128 at hidden 5120 x 64 heads).", ge=2, le=MAX_WIDTH)
    qkv_bias: bool = spec(False, "Biases on q_proj / k_proj / v_proj (Qwen2).")
    qk_norm: bool = spec(False, "RMSNorm over each head of q and k before rotary (Qwen3: q_norm / k_norm).")
    norm_eps: float = spec(1e-5, "RMSNorm epsilon.", ge=0.0, le=1.0)
    tie_embeddings: bool = spec(False, "Share embed_tokens and lm_head weights.")
    dtype: DType = spec("bfloat16", "Parameter dtype on the device.")
    mla: Optional[MLAConfig] = spec(None, "Multi-latent attention (DeepSeek-V2/V3) in place of grouped-query "
                                          "attention; null = GQA (num_kv_heads, head_dim).")
    moe: Optional[MoEConfig] = spec(None, "Mixture-of-experts feed-forward; null = every layer dense.")
    mtp_layers: int = spec(0, "Multi-token prediction depth (DeepSeek-V3: 1): module d predicts token t+1+d from "
                              "the shared embedding of token t+d and depth d-1's hidden state; 0 = none.",
                           ge=0, le=MAX_LAYERS)
    mtp_loss_factor: float = spec(0.3, "Weight of the mean MTP loss over the depths (DeepSeek-V3: 0.3, later "
                                       "0.1).", ge=0.0, le=1e3)
    flash_attention: bool = spec(False, "Fused attention kernel where the backend has one (MindSpore: "
                                        "FlashAttentionScore on Ascend); the same math as plain attention.")
    # Keys older configs used, and where they live now (config.schema names the move).
    MOVED_KEYS: ClassVar[dict[str, str]] = {"num_experts": "moe.num_experts", "moe_top_k": "moe.top_k"}

    def __post_init__(self) -> None:
        if self.mla is not None:
            self._check_mla()
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"model.hidden_size: {self.hidden_size} is not divisible by "
                                  f"model.num_heads={self.num_heads}; pick sizes with an integer head_dim "
                                  "or set model.head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        scaling = self.rope_scaling
        if scaling.type == "dynamic" and self.max_seq_len > scaling.original_max_seq_len:
            raise ConfigError(f"model.max_seq_len: {self.max_seq_len} exceeds rope_scaling.original_max_seq_len="
                              f"{scaling.original_max_seq_len}; dynamic NTK rescales per sequence length there, "
                              "which fixed rotary tables cannot follow")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads: {self.num_kv_heads} must divide "
                              f"model.num_heads={self.num_heads} (each kv head serves a group of query heads)")
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise ConfigError(f"model.moe.first_dense_layers: {self.moe.first_dense_layers} leaves no MoE layer "
                              f"in {self.num_layers}; use fewer, or moe: null for a dense model")
        if self.num_params() > MAX_PARAMS:
            raise ConfigError(f"model: {self.num_params():.3g} parameters is more than {MAX_PARAMS:.0e}; check "
                              "hidden_size, ffn_hidden_size, num_layers, vocab_size and moe.num_experts")

    def _check_mla(self) -> None:
        """MLA fixes the head layout itself: one query head per value head, its own norms and no biases."""
        for name, wrong in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                            ("num_kv_heads", self.num_kv_heads not in (None, self.num_heads)),
                            ("head_dim", self.head_dim not in (None, self.mla.qk_head_dim))):
            if wrong:
                raise ConfigError(f"model.{name}: does not apply with model.mla (multi-latent attention has its own "
                                  "q_a/kv_a norms, one key/value head per query head and head_dim = "
                                  "qk_nope_head_dim + qk_rope_head_dim); leave it out")
        object.__setattr__(self, "head_dim", self.mla.qk_head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's and Megatron's rule: past the leading dense layers, every layer_freq-th, except the
        listed dense_layers. MTP module d is layer num_layers + d under the same rule (DeepSeek-V3's 61)."""
        m = self.moe
        return (m is not None and layer >= m.first_dense_layers and layer % m.layer_freq == 0
                and layer not in m.dense_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def expert_ffn_size(self) -> int:
        """One expert's SwiGLU width (0 for a dense model)."""
        if self.moe is None:
            return 0
        return self.ffn_hidden_size if self.moe.expert_ffn_hidden_size == -1 else self.moe.expert_ffn_hidden_size

    @property
    def q_dim(self) -> int:
        """Query width (num_heads x head_dim): hidden_size unless head_dim is set apart; under MLA
        num_heads x (qk_nope_head_dim + qk_rope_head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Key width per token (values are as wide unless MLA sets v_head_dim apart)."""
        return self.num_kv_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        """o_proj inputs: q_dim, or num_heads x v_head_dim under MLA."""
        return self.num_heads * self.mla.v_head_dim if self.mla is not None else self.q_dim

    @property
    def rope_dim(self) -> int:
        """Width the rotary tables are built for: head_dim, or qk_rope_head_dim under MLA."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def attention_param_count(self) -> int:
        """One layer's attention: q/k/v/o (+ biases, q/k norms), or MLA's projections and latent norms."""
        h, a = self.hidden_size, self.mla
        if a is None:
            return (2 * h * self.q_dim + 2 * h * self.kv_dim + (self.q_dim + 2 * self.kv_dim) * self.qkv_bias
                    + 2 * self.head_dim * self.qk_norm)
        q = h * self.q_dim if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * self.q_dim
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv += a.kv_lora_rank * self.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + self.attn_out_dim * h

    def layer_param_count(self, layer: int | None = None) -> int:
        """Parameters of one decoder layer: attention (+ q/k/v biases, q/k norms), MLP (or router +
        experts + shared experts), two norms. `layer` None: the largest layer (an MoE one when the
        model has any)."""
        h = self.hidden_size
        attn = self.attention_param_count()
        moe = self.moe is not None and (self.is_moe_layer(layer) if layer is not None else True)
        if not moe:
            return attn + 3 * h * self.ffn_hidden_size + 2 * h
        m, fe = self.moe, self.expert_ffn_size
        mlp = m.num_experts * h + (m.num_experts + m.shared_experts) * 3 * h * fe
        return attn + mlp + 2 * h

    def mtp_param_count(self) -> int:
        """The multi-token prediction modules: per depth enorm, hnorm, eh_proj (2h -> h), a decoder layer
        and the norm before the shared head (embedding and head are the main model's)."""
        h = self.hidden_size
        return sum(3 * h + 2 * h * h + self.layer_param_count(self.num_layers + d) for d in range(self.mtp_layers))

    def num_params(self, mtp: bool = True) -> int:
        """Every trained parameter; mtp False leaves the MTP modules out (DeepSeek-V3's published 671B)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embed
        layers = sum(self.layer_param_count(i) for i in range(self.num_layers))
        return embed + layers + self.hidden_size + head + (self.mtp_param_count() if mtp else 0)

    def active_params(self, mtp: bool = True) -> int:
        """Parameters touched per token (for FLOPs): only top_k experts of an MoE layer."""
        if self.moe is None:
            return self.num_params(mtp)
        idle = (self.moe.num_experts - self.moe.top_k) * 3 * self.hidden_size * self.expert_ffn_size
        mtp_moe = sum(self.is_moe_layer(self.num_layers + d) for d in range(self.mtp_layers)) if mtp else 0
        return self.num_params(mtp) - (len(self.moe_layers) + mtp_moe) * idle

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus causal attention scores and values (PaLM's
        12*L*h*s, halved for causality; the score and value widths apart under MLA)."""
        layers = self.num_layers + self.mtp_layers
        return 6.0 * self.active_params() + 3.0 * layers * (self.q_dim + self.attn_out_dim) * seq_len
