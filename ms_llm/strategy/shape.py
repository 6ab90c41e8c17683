"""CostShape: the part of a ModelPlan the cost model reads, per pipeline rank: its layers, recompute
modes, parameters on one device, and what of the model's work it runs.

`cost_shape(plan)` takes it from a ModelPlan; `shape_of` derives the same object from the degrees
alone, without a layout per tensor, so a search can price thousands of strategies (tests hold the
two equal). The multi-token prediction modules sit on the head's rank (plan.py), with a copy of
the embedding when that is not the first rank.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import EXPERT_KINDS, ModelPlan, pipeline_chunks, recompute_modes


@dataclass(frozen=True)
class ZeroGroups:
    group_size: int          # ranks one ZeRO shard group spans (dp_shard * cp; 1 when ZeRO is off)
    replicate_size: int      # shard groups holding the same shard (HSDP replicas)


@dataclass(frozen=True)
class StageShape:
    """One pipeline rank as the cost model sees it."""
    layers: int                                   # decoder layers over all its chunks
    recompute: tuple[tuple[str, int], ...]        # (mode, layers) for each recompute mode present
    has_head: bool
    params: int                                   # parameters on one device (after tp / ep, before ZeRO)
    moe_layers: int = 0                           # of `layers`, those with routed experts
    expert_params: int = 0                        # of `params`, routed experts (after ep, etp): replicated over edp
    mtp_layers: int = 0                           # MTP modules (beside the head), each a decoder layer


@dataclass(frozen=True)
class CostShape:
    """The part of a ModelPlan the cost model reads (see the module docstring)."""
    model: ModelConfig
    strategy: ParallelStrategy     # resolved (validate() output)
    train: TrainConfig
    world_size: int
    micro_batches: int
    zero: ZeroGroups
    stages: tuple[StageShape, ...]

    def recomputed_layers(self, mode: str) -> int:
        return sum(n for st in self.stages for m, n in st.recompute if m == mode)

    def moe_layers_of(self, st: StageShape) -> int:
        """MoE layers a rank runs, its MTP modules' included."""
        m = self.model
        return st.moe_layers + sum(m.is_moe_layer(m.num_layers + d) for d in range(st.mtp_layers))


def mtp_embedding_copy(model: ModelConfig, s: ParallelStrategy, has_embedding: bool, has_mtp: bool) -> int:
    """Parameters of the embedding copy a rank keeps for its MTP modules when the first chunk is
    elsewhere (ModelPlan.embedding_stages)."""
    return model.vocab_size // s.tp * model.hidden_size if has_mtp and not has_embedding else 0


def cost_shape(plan: ModelPlan) -> CostShape:
    m, s = plan.model, plan.strategy
    stages = []
    for st in range(s.pp):
        chunks = plan.chunks_of_stage(st)
        layers = [l for c in chunks for l in c.layers]
        experts = sum(math.prod(p.layout.local_shape()) for p in plan.params_of_stage(st) if p.kind in EXPERT_KINDS)
        has_mtp = any(c.has_mtp for c in chunks)
        copy = mtp_embedding_copy(m, s, any(c.has_embedding for c in chunks), has_mtp)
        counts = Counter(plan.recompute[l] for l in layers)
        stages.append(StageShape(len(layers), tuple(sorted(counts.items())), any(c.has_head for c in chunks),
                                 plan.local_param_count(st) + copy, sum(map(m.is_moe_layer, layers)), experts,
                                 m.mtp_layers if has_mtp else 0))
    return CostShape(m, s, plan.train, plan.world_size, plan.micro_batches,
                     ZeroGroups(plan.zero.group_size, plan.zero.replicate_size), tuple(stages))


def local_attention_params(m: ModelConfig, tp: int) -> int:
    """One layer's attention on one device, as plan.py lays it out: q/k/v/o and their biases split
    over tp, q/k norms replicated; under MLA the up-projections and o_proj split over tp, the
    down-projections to the latents and the latent norms replicated."""
    h, q, kv, a = m.hidden_size, m.q_dim, m.kv_dim, m.mla
    if a is None:
        return (2 * q * h + 2 * kv * h + (q + 2 * kv) * m.qkv_bias) // tp + 2 * m.head_dim * m.qk_norm
    if a.q_lora_rank is None:
        query = q * h // tp
    else:
        query = a.q_lora_rank * h + a.q_lora_rank + q * a.q_lora_rank // tp
    latent = (a.kv_lora_rank + a.qk_rope_head_dim) * h + a.kv_lora_rank
    up = m.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank // tp
    return query + latent + up + h * m.attn_out_dim // tp


def local_layer_params(m: ModelConfig, s: ParallelStrategy, moe: bool) -> tuple[int, int]:
    """(parameters, of which routed experts) of one decoder layer on one device: tp splits the
    attention (local_attention_params), the MLP and the shared experts, ep splits the routed
    experts and etp each one's width, norms and the router are replicated."""
    h, f, tp = m.hidden_size, m.ffn_hidden_size, s.tp
    attn = local_attention_params(m, tp)
    if not moe:
        return attn + 3 * (f // tp) * h + 2 * h, 0
    fe = m.expert_ffn_size
    experts = 3 * (m.moe.num_experts // s.ep) * (fe // s.etp) * h
    shared = 3 * (m.moe.shared_experts * fe // tp) * h
    return attn + experts + shared + m.moe.num_experts * h + 2 * h, experts


def local_mtp_params(m: ModelConfig, s: ParallelStrategy) -> tuple[int, int]:
    """(parameters, of which routed experts) of every MTP module on the head's device: three norms,
    eh_proj split over tp and a decoder layer each."""
    h = m.hidden_size
    total = experts = 0
    for d in range(m.mtp_layers):
        layer, routed = local_layer_params(m, s, m.is_moe_layer(m.num_layers + d))
        total += 3 * h + 2 * h * h // s.tp + layer
        experts += routed
    return total, experts


# (model structure, pp, virtual stages, schedule, layer split, recompute) -> per stage: (layers,
# recompute counts, holds embedding, holds head, MoE layers, holds MTP). Few distinct keys per search.
_STRUCTURE_CACHE: dict[tuple, tuple[tuple[int, tuple, bool, bool, int, bool], ...]] = {}


def _stage_structure(model: ModelConfig, s: ParallelStrategy) -> tuple[tuple[int, tuple, bool, bool, int, bool], ...]:
    key = (model.num_layers, model.moe, model.mtp_layers, s.pp, s.pipeline.virtual_stages,
           s.pipeline.schedule, s.pipeline.layer_split, s.recompute.policy, s.recompute.num_layers)
    hit = _STRUCTURE_CACHE.get(key)
    if hit is None:
        chunks = pipeline_chunks(model, s)
        modes = recompute_modes(model, s, chunks)
        stages = []
        for st in range(s.pp):
            mine = [c for c in chunks if c.stage == st]
            layers = [l for c in mine for l in c.layers]
            counts = tuple(sorted(Counter(modes[l] for l in layers).items()))
            stages.append((len(layers), counts, any(c.has_embedding for c in mine), any(c.has_head for c in mine),
                           sum(map(model.is_moe_layer, layers)), any(c.has_mtp for c in mine)))
        hit = tuple(stages)
        if len(_STRUCTURE_CACHE) > 4096:
            _STRUCTURE_CACHE.clear()
        _STRUCTURE_CACHE[key] = hit
    return hit


def shape_of(model: ModelConfig, strategy: ParallelStrategy, train: TrainConfig) -> CostShape:
    """CostShape of a resolved strategy (validate.validate's output) without planning every tensor."""
    s = strategy
    dense, _ = local_layer_params(model, s, False)
    moe, experts = local_layer_params(model, s, True) if model.moe is not None else (0, 0)
    mtp, mtp_experts = local_mtp_params(model, s)
    embed = model.vocab_size // s.tp * model.hidden_size
    head = model.hidden_size + (0 if model.tie_embeddings else embed)
    stages = []
    for n, counts, has_embed, has_head, k, has_mtp in _stage_structure(model, s):
        params = (n - k) * dense + k * moe + embed * has_embed + head * has_head
        params += (mtp + mtp_embedding_copy(model, s, has_embed, has_mtp)) * has_mtp
        stages.append(StageShape(n, counts, has_head, params, k, k * experts + mtp_experts * has_mtp,
                                 model.mtp_layers * has_mtp))
    group = s.dp_shard * s.cp if s.zero.stage else 1
    return CostShape(model, s, train, s.world_size(), s.pipeline.micro_batches,
                     ZeroGroups(group, s.dp_replicate), tuple(stages))


@functools.lru_cache(maxsize=64)
def _work_of_layers(m: ModelConfig, seq: int) -> tuple[float, float, float, float]:
    """Training FLOPs per token of a dense layer, an MoE layer, lm_head and all MTP modules: the same for
    every strategy a search prices, so counted once per model and sequence length."""
    attention = 3.0 * (m.q_dim + m.attn_out_dim) * seq
    dense = 6.0 * active_layer_params(m, next((i for i in range(m.num_layers) if not m.is_moe_layer(i)), 0)) + attention
    moe = 6.0 * active_layer_params(m, m.moe_layers[0]) + attention if m.moe_layers else 0.0
    logits = 6.0 * m.vocab_size * m.hidden_size
    mtp = sum(6.0 * (3 * m.hidden_size + 2 * m.hidden_size ** 2 + active_layer_params(m, m.num_layers + d))
              + attention + logits for d in range(m.mtp_layers))
    return dense, moe, logits, mtp


def active_layer_params(m: ModelConfig, layer: int) -> int:
    """Parameters one token passes through in decoder layer `layer` (num_layers + d: MTP module d's):
    top_k of the routed experts."""
    total = m.layer_param_count(layer)
    if m.is_moe_layer(layer):
        total -= (m.moe.num_experts - m.moe.top_k) * 3 * m.hidden_size * m.expert_ffn_size
    return total


def stage_flops_per_token(shape: CostShape) -> tuple[float, ...]:
    """Training FLOPs per token each pipeline rank runs (whole model width, before tp / dp): 6 x the
    active parameters of its layers plus their causal attention, lm_head's logits on the head's rank
    and, there too, every MTP module: its eh_proj, decoder layer and another pass through lm_head.
    The embedding is a lookup. The ranks' sum is the model's work; the largest sets the pace."""
    dense, moe, logits, mtp = _work_of_layers(shape.model, shape.train.seq_len)
    return tuple((st.layers - st.moe_layers) * dense + st.moe_layers * moe
                 + logits * st.has_head + (mtp if st.mtp_layers else 0.0)
                 for st in shape.stages)
