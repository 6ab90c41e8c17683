"""Shard strategies of multi-latent attention (ms_llm/mindspore/mla.py), read off the plan as lower.py
reads grouped-query attention's.

Megatron-core's MLASelfAttention under tp, which MindFormers 2.1's DeepSeek-V3 training graph
(MLASelfAttentionConcatenated) reproduces: the down-projections to the latents (q_a_proj,
kv_a_proj_with_mqa) and the latent norms keep whole weights and run where the plan puts the latents
(on each rank's sequence-parallel tokens under sequence parallel, else on every token of the rank);
q_b_proj and kv_b_proj (q_proj without the low-rank path) are column-parallel over the latents
gathered over tp, whole heads per rank; every per-head primitive splits the heads over tp; the rotary
key every head shares is rotated whole over tp and tiled into the rank's own heads; o_proj is
row-parallel into the residual stream. The attention core is lower.py's (context parallel included).
tests/mindspore/test_ms_oracle.py compares these with MindFormers' own DeepSeek-V3.
"""
from __future__ import annotations

from ms_llm.mindspore.op_strategy import OpShard, flat_tokens, norm_ops, op_shard, reshaped, select, whole_over
from ms_llm.strategy.layout import TensorLayout
from ms_llm.strategy.plan import ModelPlan

# The primitives lower.py's selective recompute keeps for an MLA layer (the attention core and its rotary).
SELECTIVE_OPS = ("self_attn.tile_k", "self_attn.batch_matmul_q_k", "self_attn.mul", "self_attn.add",
                 "self_attn.softmax", "self_attn.batch_matmul")
SELECTIVE_CELLS = ("self_attn.rotary_q", "self_attn.rotary_k")


def _rotary_ops(prefix: str, x: TensorLayout) -> list[OpShard]:
    """DecoupledRotary on (B, heads, T, rope): the de-interleaving transpose (B, heads, T, rope/2, 2),
    then rotate_half with the (T, rope) tables."""
    b, n, t, d = x.shape
    r, tables = prefix + "rotary.", select(x, (2, 3))
    return [op_shard(prefix + "transpose", [reshaped(x, (b, n, t, d // 2, 2))]),
            op_shard(r + "split", [x]), op_shard(r + "neg", [x]), op_shard(r + "concat", [x, x]),
            op_shard(r + "mul_cos", [x, tables]), op_shard(r + "mul_sin", [x, tables]), op_shard(r + "add", [x, x])]


def mla_ops(plan: ModelPlan, p: str, qt: TensorLayout, kt: TensorLayout, vt: TensorLayout,
            core: tuple[TensorLayout, TensorLayout, TensorLayout, TensorLayout]) -> list[OpShard]:
    """Every primitive of the attention of decoder layer `p` (model.layers.N. or model.mtp.D.layer.).
    qt, kt, vt: q, k, v as (B, heads, T, d); core: lower._attention_core's (q, k, v, score), the
    attention core reading k and v whole along the sequence."""
    a, m = plan.activations, plan.model.mla
    w = {n: q.layout for n, q in plan.params.items() if n.startswith(p + "self_attn.")}
    s = p + "self_attn."
    b, nh, t, _ = qt.shape
    kv_latent = a["kv_latent"]
    tokens = reshaped(kv_latent, (b, t, plan.model.hidden_size))    # the down-projections' input: the latents' tokens
    kv_norm = reshaped(kv_latent, (b, t, m.kv_lora_rank))
    ops = []
    if m.q_lora_rank is None:
        ops.append(op_shard(s + "q_proj.matmul", [flat_tokens(a["attn_input"]), w[s + "q_proj.weight"]]))
    else:
        q_latent = a["q_latent"]
        ops.append(op_shard(s + "q_a_proj.matmul", [flat_tokens(tokens), w[s + "q_a_proj.weight"]]))
        ops += norm_ops(s + "q_a_layernorm.", q_latent, w[s + "q_a_layernorm.weight"])
        ops.append(op_shard(s + "q_b_proj.matmul", [flat_tokens(whole_over(q_latent, "tp")), w[s + "q_b_proj.weight"]]))
    ops.append(op_shard(s + "kv_a_proj_with_mqa.matmul", [flat_tokens(tokens), w[s + "kv_a_proj_with_mqa.weight"]]))
    ops += norm_ops(s + "kv_a_layernorm.", kv_norm, w[s + "kv_a_layernorm.weight"])
    ops.append(op_shard(s + "kv_b_proj.matmul", [flat_tokens(whole_over(kv_norm, "tp")), w[s + "kv_b_proj.weight"]]))

    kv = reshaped(a["v"], (b, t, nh, m.qk_nope_head_dim + m.v_head_dim))     # kv_b_proj's output per head
    q_rot = reshaped(qt, (b, nh, t, m.qk_rope_head_dim))
    k_rot = reshaped(kt.replicate_dim(1), (b, 1, t, m.qk_rope_head_dim))     # one rotary key, whole over tp
    k_tiled = reshaped(kt, (b, nh, t, m.qk_rope_head_dim))                   # tiled into the rank's own heads
    q_core, k_core, v_core, score = core
    k_all, v_all = k_core.replicate_dim(2), v_core.replicate_dim(2)          # every key of the sequence
    ops += [op_shard(s + "transpose_q", [a["q"]]), op_shard(s + "transpose_kv", [kv]),
            op_shard(s + "slice", [qt]),                       # q's and kv's per-head columns (B, heads, T, d)
            op_shard(s + "slice_latent", [kv_latent])]          # the latent's kv and rotary-key columns
    ops += _rotary_ops(s + "rotary_q.", q_rot) + _rotary_ops(s + "rotary_k.", k_rot)
    ops += [op_shard(s + "concat_q", [reshaped(qt, (b, nh, t, m.qk_nope_head_dim)), q_rot]),
            op_shard(s + "tile_k", [k_tiled]),
            op_shard(s + "concat_k", [reshaped(kt, (b, nh, t, m.qk_nope_head_dim)), k_tiled]),
            op_shard(s + "batch_matmul_q_k", [q_core, k_all]),
            op_shard(s + "mul", [score, None]),
            op_shard(s + "add", [select(score, (2, 3)), score]),
            op_shard(s + "softmax", [score]),
            op_shard(s + "batch_matmul", [score, v_all]),
            op_shard(s + "merge_heads", [vt]),
            op_shard(s + "o_proj.matmul", [flat_tokens(a["attn_output"]), w[s + "o_proj.weight"]],
                     flat_tokens(a["hidden"]))]
    return ops
