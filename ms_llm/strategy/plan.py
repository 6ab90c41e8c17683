"""ModelPlan: strategy x model -> where every tensor of the model lives.

Both backends read this object and derive nothing themselves. Layout rules follow
Megatron / MindFormers practice: column-parallel q/k/v and gate/up (weight rows split),
row-parallel o and down (weight columns split), vocab-parallel embedding and lm_head,
sequence-parallel norms, the sequence split over cp, the routed experts split over ep on the
expert dim and over etp on their width (column / row like the dense MLP), on the expert mesh
(edp, ep, etp) that folds the same ranks (ms_llm/strategy/mesh.py).
Multi-latent attention as Megatron-core's MLASelfAttention: the up-projections q_b_proj /
kv_b_proj (q_proj without the low-rank path) column-parallel, whole heads per tp rank;
o_proj row-parallel; the down-projections to the latents (q_a_proj, kv_a_proj_with_mqa) and
the latent norms replicated. The multi-token prediction modules sit with lm_head on the last
model chunk, and read the embedding there. Weights are stored [out, in] like torch.nn.Linear
and Hugging Face checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.layout import Partial, Replicate, Shard, TensorLayout
from ms_llm.strategy.mesh import DENSE_AXES, MeshSpec, expert_mesh as fold_experts
from ms_llm.strategy.validate import validate

# bias: shards with its column-parallel weight's outputs; head_norm: q/k RMSNorm over one head's
# features (Qwen3), replicated, its gradient summed over the tp ranks' heads. latent: MLA's
# down-projection to a latent (q_a_proj, kv_a_proj_with_mqa), replicated: every tp rank computes
# the whole latent from the whole attention input (from its sequence chunk under sequence parallel,
# the latent then gathered over tp for the up-projection), and the latent's gradient is the sum over the
# tp ranks' heads (the column-parallel up-projection's input gradient; the rotary key every head
# shares); latent_norm: the RMSNorm over a latent, replicated, fed by and feeding whole latents.
# mtp_proj: the MTP module's eh_proj, column-parallel with its output gathered over tp
# (Megatron's MultiTokenPredictionLayer).
ParamKind = Literal["embedding", "column", "bias", "row", "norm", "head_norm", "head", "expert_column",
                    "expert_row", "router", "latent", "latent_norm", "mtp_proj"]
# Buffers the plan lays out beside the parameters: the router's aux-loss-free expert bias, fp32,
# replicated on every rank of its stage and updated identically there.
BufferKind = Literal["expert_bias"]
EXPERT_KINDS = ("expert_column", "expert_row")   # the routed experts: on the expert mesh, ZeRO over edp
RecomputeMode = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: its global shape, where it is split, and which model chunk owns it."""
    name: str                      # Hugging Face LLaMA name
    shape: tuple[int, ...]
    kind: ParamKind
    layout: TensorLayout           # over the stage mesh (pp removed): params live on one stage
    stage: int                     # pipeline rank holding it
    chunk: int                     # virtual chunk on that rank
    layer: Optional[int]           # decoder layer index, None for embedding / final norm / head
    zero_layout: TensorLayout      # the layout with ZeRO's shard axes added
    zero_stage: int

    @property
    def optimizer_layout(self) -> TensorLayout:
        return self.zero_layout if self.zero_stage >= 1 else self.layout

    @property
    def grad_layout(self) -> TensorLayout:
        """Where the reduced gradient lives between backward and the optimizer step."""
        return self.zero_layout if self.zero_stage >= 2 else self.layout

    @property
    def stored_layout(self) -> TensorLayout:
        """Where the parameter rests between uses (ZeRO-3 gathers it just before use)."""
        return self.zero_layout if self.zero_stage >= 3 else self.layout

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ZeroPartition:
    """What ZeRO shards over which ranks. Flat-buffer offsets live in ms_llm.zero."""
    stage: int
    axes: tuple[str, ...]          # mesh axes a shard group spans
    group_size: int
    replicate_size: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool


@dataclass(frozen=True)
class ChunkPlan:
    """One pipeline model chunk: the modules (by FQN prefix) it runs, in order."""
    index: int                     # position in the model, 0 = holds the embedding
    stage: int
    virtual: int
    layers: tuple[int, ...]
    has_embedding: bool
    has_head: bool
    has_mtp: bool = False          # the MTP modules (model.mtp.*), after lm_head, on the head's chunk


@dataclass(frozen=True)
class BufferPlan:
    """A non-trained tensor the checkpoint keeps: replicated where its layer lives."""
    name: str
    shape: tuple[int, ...]
    kind: BufferKind
    dtype: str
    layout: TensorLayout           # over the stage mesh
    stage: int
    chunk: int
    layer: Optional[int]           # decoder layer; None inside an MTP module


@dataclass(frozen=True)
class ModelPlan:
    model: ModelConfig
    strategy: ParallelStrategy     # resolved: no -1 left
    train: TrainConfig
    world_size: int
    mesh: MeshSpec                 # pp x dp_replicate x dp_shard x cp x tp
    expert_mesh: Optional[MeshSpec]  # pp x edp x ep x etp, the same ranks (MoE only)
    params: dict[str, ParamPlan]
    activations: dict[str, TensorLayout]
    chunks: tuple[ChunkPlan, ...]
    layer_chunk: tuple[int, ...]   # decoder layer -> chunk index
    recompute: tuple[RecomputeMode, ...]
    zero: ZeroPartition
    micro_batches: int
    notes: tuple[str, ...] = field(default=())
    buffers: dict[str, BufferPlan] = field(default_factory=dict)
    expert_zero: Optional[ZeroPartition] = None   # the routed experts' ZeRO, over edp (MoE only)

    @property
    def stage_mesh(self) -> MeshSpec:
        return self.mesh.without("pp")

    def layer_stage(self, layer: int) -> tuple[int, int]:
        """(pipeline rank, virtual chunk) of a decoder layer."""
        chunk = self.chunks[self.layer_chunk[layer]]
        return chunk.stage, chunk.virtual

    def chunks_of_stage(self, stage: int) -> tuple[ChunkPlan, ...]:
        return tuple(sorted((c for c in self.chunks if c.stage == stage), key=lambda c: c.virtual))

    def params_of_stage(self, stage: int) -> list[ParamPlan]:
        return [p for p in self.params.values() if p.stage == stage]

    def stage_rank(self, rank: int) -> int:
        """Rank within its stage mesh (what a stage-local layout's shard_box takes)."""
        coords = self.mesh.coords(rank)
        return self.stage_mesh.rank(**{n: coords[n] for n in self.stage_mesh.names})

    def embedding_stages(self) -> tuple[int, ...]:
        """Pipeline ranks that look up model.embed_tokens: the first chunk's and, with MTP, the head
        chunk's. A second rank holds a copy whose gradient is summed with the first's (Megatron's
        embedding group for MTP); the zbv schedule puts both chunks on rank 0, as DualPipe does."""
        return tuple(sorted({c.stage for c in self.chunks if c.has_embedding or c.has_mtp}))

    def local_param_count(self, stage: int) -> int:
        total = 0
        for p in self.params_of_stage(stage):
            n = 1
            for s in p.layout.local_shape():
                n *= s
            total += n
        return total


def pipeline_chunks(model: ModelConfig, s: ParallelStrategy) -> list[ChunkPlan]:
    """The model chunks (pp x virtual stages) with their layers and the rank holding each."""
    n_chunks = s.pp * s.pipeline.virtual_stages
    counts = s.pipeline.layer_split or tuple([model.num_layers // n_chunks] * n_chunks)
    out, start = [], 0
    for i, n in enumerate(counts):
        stage, virtual = _chunk_stage(i, s.pp, s.pipeline.schedule)
        last = i == n_chunks - 1
        out.append(ChunkPlan(i, stage, virtual, tuple(range(start, start + n)), i == 0, last,
                             last and model.mtp_layers > 0))
        start += n
    return out


def _chunk_stage(index: int, pp: int, schedule: str) -> tuple[int, int]:
    """Model chunk -> (rank, virtual). Looped schedules put chunk c on rank c % pp; the V
    schedule (zbv) runs down the ranks and back up, so the last chunk sits on rank 0."""
    virtual, pos = divmod(index, pp)
    if schedule == "zbv" and virtual % 2 == 1:
        return pp - 1 - pos, virtual
    return pos, virtual


def recompute_modes(model: ModelConfig, s: ParallelStrategy, chunks: list[ChunkPlan]) -> tuple[RecomputeMode, ...]:
    policy, limit = s.recompute.policy, s.recompute.num_layers
    modes: list[RecomputeMode] = ["none"] * model.num_layers
    if policy == "none":
        return tuple(modes)
    for stage in range(s.pp):
        layers = [l for c in sorted((c for c in chunks if c.stage == stage), key=lambda c: c.virtual)
                  for l in c.layers]
        for i, layer in enumerate(layers):
            if limit == -1 or i < limit:
                modes[layer] = policy
    return tuple(modes)


def zero_partition(s: ParallelStrategy, mesh: MeshSpec) -> ZeroPartition:
    """ZeRO shards over dp_shard and cp (cp ranks hold the same parameters), replicates over
    dp_replicate. `s` must be resolved."""
    zero_axes = tuple(a for a in ("dp_shard", "cp") if mesh.axis_size(a) > 1) if s.zero.stage else ()
    group = 1
    for a in zero_axes:
        group *= mesh.axis_size(a)
    return ZeroPartition(stage=s.zero.stage, axes=zero_axes, group_size=group,
                         replicate_size=s.dp_replicate,
                         shard_optimizer=s.zero.stage >= 1, shard_grads=s.zero.stage >= 2,
                         shard_params=s.zero.stage >= 3)


def _expert_zero(s: ParallelStrategy, zero: ZeroPartition) -> ZeroPartition:
    """The routed experts' ZeRO: the job's stage over edp, the ranks holding the same expert shard
    (Megatron-core's expert data parallel group): optimizer states from stage 1, gradients from 2,
    weights from 3, each split over all of edp (hybrid sharding's dp_replicate stays the dense
    parameters'). With edp 1 nothing is left to shard. `s` must be resolved."""
    stage = zero.stage if s.edp > 1 else 0
    return ZeroPartition(stage=stage, axes=("edp",) if stage else (), group_size=s.edp if stage else 1,
                         replicate_size=1, shard_optimizer=stage >= 1, shard_grads=stage >= 2,
                         shard_params=stage >= 3)


def zero_layout(layout: TensorLayout, zero: ZeroPartition) -> TensorLayout:
    """Add the ZeRO shard axes on the first dimension that divides evenly (dim 0 normally,
    like FSDP2 and MindSpore's parallel optimizer); keep the TP layout where none does."""
    if zero.stage == 0 or zero.group_size == 1:
        return layout
    local = layout.local_shape()
    for d, size in enumerate(local):
        if size % zero.group_size == 0:
            placements = list(layout.placements)
            for axis in zero.axes:
                placements[layout.mesh.names.index(axis)] = Shard(d)
            order = tuple(a for a in layout.mesh.names if a not in zero.axes) + zero.axes
            return TensorLayout(layout.shape, layout.mesh, tuple(placements), order)
    return layout


def _activation_layouts(model: ModelConfig, s: ParallelStrategy, train: TrainConfig,
                        mesh: MeshSpec) -> dict[str, TensorLayout]:
    """Layouts of the main activations of one micro-batch, over the stage mesh.
    Batch is split over dp, sequence over cp (and over tp in sequence-parallel regions)."""
    b, t = train.micro_batch_size * s.dp, train.seq_len
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    nh, nkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    names = mesh.names

    def lay(shape, seq_tp=False, tp_dim=None, partial=False):
        placements = []
        for n in names:
            if n in ("dp_replicate", "dp_shard"):
                placements.append(Shard(0))
            elif n == "cp":
                placements.append(Shard(1))
            elif n == "tp" and partial:
                placements.append(Partial())
            elif n == "tp" and seq_tp:
                placements.append(Shard(1))
            elif n == "tp" and tp_dim is not None:
                placements.append(Shard(tp_dim))
            else:
                placements.append(Replicate())
        return TensorLayout(tuple(shape), mesh, tuple(placements))

    sp = s.sequence_parallel
    # K and V per head: head_dim under GQA; MLA expands kv_b_proj's output to every query head, keys
    # of qk_nope + qk_rope (the shared rotary key appended), values of v_head_dim.
    v_head = model.mla.v_head_dim if model.mla is not None else hd
    acts = {
        "tokens": lay((b, t)),
        "hidden": lay((b, t, h), seq_tp=sp),             # residual stream and norm outputs
        "attn_input": lay((b, t, h)),                    # norm output gathered over tp
        "q": lay((b, t, nh, hd), tp_dim=2),
        "k": lay((b, t, nkv, hd), tp_dim=2),
        "v": lay((b, t, nkv, v_head), tp_dim=2),
        "attn_output": lay((b, t, model.attn_out_dim), tp_dim=2),   # o_proj input: local heads
        "o_proj_output": lay((b, t, h), partial=True),   # summed by all-reduce or reduce-scatter
        "mlp_input": lay((b, t, h)),
        "mlp_hidden": lay((b, t, f), tp_dim=2),          # silu(gate) * up
        "down_proj_output": lay((b, t, h), partial=True),
        "head_input": lay((b, t, h)),                    # final norm output gathered over tp
        "logits": lay((b, t, v), tp_dim=2),              # vocab-parallel: loss_parallel consumes it
    }
    if model.mla is not None:
        # The latents, whole in width on every tp rank: q_a_proj's output (the query's low-rank path),
        # kv_a_proj_with_mqa's (kv_lora_rank latent + the shared rotary key); under sequence parallel
        # each rank's sequence chunk only, as Megatron-core's down-projections read the sequence-parallel input.
        a = model.mla
        if a.q_lora_rank is not None:
            acts["q_latent"] = lay((b, t, a.q_lora_rank), seq_tp=sp)
        acts["kv_latent"] = lay((b, t, a.kv_lora_rank + a.qk_rope_head_dim), seq_tp=sp)
    return acts


def plan(model: ModelConfig, strategy: ParallelStrategy, train: TrainConfig | None = None,
         world_size: int | None = None) -> ModelPlan:
    """Validate and lay out. Raises StrategyError listing every broken rule."""
    train = train or TrainConfig()
    s = validate(model, strategy, train, world_size)
    world = s.world_size()
    mesh = MeshSpec(DENSE_AXES, (s.pp, s.dp_replicate, s.dp_shard, s.cp, s.tp))
    stage_mesh = mesh.without("pp")
    expert_mesh = fold_experts(s.pp, s.dp * s.cp * s.tp, s.ep, s.etp) if model.moe is not None else None

    zero = zero_partition(s, mesh)
    expert_zero = _expert_zero(s, zero) if model.moe is not None else None

    chunks = pipeline_chunks(model, s)
    layer_chunk = tuple(c.index for c in chunks for _ in c.layers)

    h, v = model.hidden_size, model.vocab_size
    params: dict[str, ParamPlan] = {}
    buffers: dict[str, BufferPlan] = {}

    def add(name, shape, kind, layer, chunk, tp_dim=None, ep_dim=None):
        if ep_dim is not None:         # a routed expert: E over ep, its width (tp_dim) over etp
            layout = TensorLayout.build(shape, expert_mesh.without("pp"), ep=ep_dim, etp=tp_dim)
            zl, stage = zero_layout(layout, expert_zero), expert_zero.stage
        else:
            layout = TensorLayout.build(shape, stage_mesh, **({"tp": tp_dim} if tp_dim is not None else {}))
            zl, stage = zero_layout(layout, zero), zero.stage
        c = chunks[chunk]
        params[name] = ParamPlan(name, tuple(shape), kind, layout, c.stage, c.virtual, layer, zl, stage)

    def add_buffer(name, shape, kind, layer, chunk):
        c = chunks[chunk]
        buffers[name] = BufferPlan(name, tuple(shape), kind, "float32",
                                   TensorLayout.replicated(tuple(shape), stage_mesh), c.stage, c.virtual, layer)

    add("model.embed_tokens.weight", (v, h), "embedding", None, 0, tp_dim=0)
    for layer in range(model.num_layers):
        _decoder_layer(model, add, add_buffer, f"model.layers.{layer}.", layer, layer_chunk[layer],
                       model.is_moe_layer(layer))
    last = len(chunks) - 1
    add("model.norm.weight", (h,), "norm", None, last)
    if not model.tie_embeddings:
        add("lm_head.weight", (v, h), "head", None, last, tp_dim=0)
    for d in range(model.mtp_layers):
        # DeepSeek-V3's MTP module d: [enorm(embedding), hnorm(h)] -> eh_proj -> a decoder layer
        # (layer num_layers + d under the MoE rule) -> norm -> the shared lm_head.
        p = f"model.mtp.{d}."
        add(p + "enorm.weight", (h,), "norm", None, last)
        add(p + "hnorm.weight", (h,), "norm", None, last)
        add(p + "eh_proj.weight", (h, 2 * h), "mtp_proj", None, last, tp_dim=0)
        _decoder_layer(model, add, add_buffer, p + "layer.", None, last, model.is_moe_layer(model.num_layers + d))
        add(p + "norm.weight", (h,), "norm", None, last)

    notes = []
    for group, experts, what in ((zero, False, "ZeRO group"), (expert_zero, True, "experts' ZeRO group (edp)")):
        if group is None or group.group_size == 1:
            continue
        unsharded = [p.name for p in params.values() if (p.kind in EXPERT_KINDS) == experts and p.zero_layout == p.layout]
        if unsharded:
            notes.append(f"{len(unsharded)} parameter(s) have no dimension divisible by the {what} "
                         f"({group.group_size}); their optimizer states stay replicated, e.g. {unsharded[0]}")
    if model.mtp_layers and chunks[0].stage != chunks[last].stage:
        notes.append(f"the MTP modules on stage {chunks[last].stage} read model.embed_tokens of stage "
                     f"{chunks[0].stage}: stage {chunks[last].stage} keeps a copy whose gradient is summed with "
                     f"stage {chunks[0].stage}'s (schedule zbv puts both on stage 0, as DeepSeek's DualPipe)")

    return ModelPlan(
        model=model, strategy=s, train=train, world_size=world, mesh=mesh, expert_mesh=expert_mesh,
        params=params, activations=_activation_layouts(model, s, train, stage_mesh),
        chunks=tuple(chunks), layer_chunk=layer_chunk, recompute=recompute_modes(model, s, chunks),
        zero=zero, micro_batches=s.pipeline.micro_batches, notes=tuple(notes), buffers=buffers,
        expert_zero=expert_zero)


def _attention(model: ModelConfig, add, p: str, layer: Optional[int], c: int) -> None:
    """One layer's attention weights: q/k/v/o (+ biases, q/k norms), or MLA's."""
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    a = model.mla
    if a is None:
        add(p + "self_attn.q_proj.weight", (q, h), "column", layer, c, tp_dim=0)
        add(p + "self_attn.k_proj.weight", (kv, h), "column", layer, c, tp_dim=0)
        add(p + "self_attn.v_proj.weight", (kv, h), "column", layer, c, tp_dim=0)
        if model.qkv_bias:
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                add(p + f"self_attn.{proj}.bias", (rows,), "bias", layer, c, tp_dim=0)
        if model.qk_norm:
            add(p + "self_attn.q_norm.weight", (model.head_dim,), "head_norm", layer, c)
            add(p + "self_attn.k_norm.weight", (model.head_dim,), "head_norm", layer, c)
    else:
        # Rows of q_b_proj / kv_b_proj are head-major (head 0's features first), so splitting rows
        # over tp hands each rank whole heads (validate: tp divides num_heads).
        if a.q_lora_rank is None:
            add(p + "self_attn.q_proj.weight", (q, h), "column", layer, c, tp_dim=0)
        else:
            add(p + "self_attn.q_a_proj.weight", (a.q_lora_rank, h), "latent", layer, c)
            add(p + "self_attn.q_a_layernorm.weight", (a.q_lora_rank,), "latent_norm", layer, c)
            add(p + "self_attn.q_b_proj.weight", (q, a.q_lora_rank), "column", layer, c, tp_dim=0)
        add(p + "self_attn.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h), "latent", layer, c)
        add(p + "self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,), "latent_norm", layer, c)
        add(p + "self_attn.kv_b_proj.weight", (model.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
            "column", layer, c, tp_dim=0)
    add(p + "self_attn.o_proj.weight", (h, model.attn_out_dim), "row", layer, c, tp_dim=1)


def _decoder_layer(model: ModelConfig, add, add_buffer, p: str, layer: Optional[int], c: int, moe: bool) -> None:
    """One decoder layer's parameters under prefix `p` (model.layers.N. or model.mtp.D.layer.)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    _attention(model, add, p, layer, c)
    if moe:
        e, fe, fs = model.moe.num_experts, model.expert_ffn_size, model.moe.shared_experts * model.expert_ffn_size
        add(p + "mlp.gate.weight", (e, h), "router", layer, c)
        if model.moe.expert_bias:
            add_buffer(p + "mlp.gate.e_score_correction_bias", (e,), "expert_bias", layer, c)
        add(p + "mlp.experts.gate_proj.weight", (e, fe, h), "expert_column", layer, c, tp_dim=1, ep_dim=0)
        add(p + "mlp.experts.up_proj.weight", (e, fe, h), "expert_column", layer, c, tp_dim=1, ep_dim=0)
        add(p + "mlp.experts.down_proj.weight", (e, h, fe), "expert_row", layer, c, tp_dim=2, ep_dim=0)
        if fs:
            add(p + "mlp.shared_experts.gate_proj.weight", (fs, h), "column", layer, c, tp_dim=0)
            add(p + "mlp.shared_experts.up_proj.weight", (fs, h), "column", layer, c, tp_dim=0)
            add(p + "mlp.shared_experts.down_proj.weight", (h, fs), "row", layer, c, tp_dim=1)
    else:
        add(p + "mlp.gate_proj.weight", (f, h), "column", layer, c, tp_dim=0)
        add(p + "mlp.up_proj.weight", (f, h), "column", layer, c, tp_dim=0)
        add(p + "mlp.down_proj.weight", (h, f), "row", layer, c, tp_dim=1)
    add(p + "input_layernorm.weight", (h,), "norm", layer, c)
    add(p + "post_attention_layernorm.weight", (h,), "norm", layer, c)
