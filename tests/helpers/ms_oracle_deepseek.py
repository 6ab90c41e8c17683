"""The DeepSeek part of the MindFormers oracle (tests/mindspore/test_ms_oracle.py): MindFormers 2.1's own
DeepSeek-V3 training graph (TrainingDeepseekV3ForCausalLM: mcore GPTModel with MLASelfAttentionConcatenated,
the TopKRouter with the expert bias and group-limited routing, grouped-GEMM experts behind the all-to-all
token dispatcher, shared experts, one MTP module), built by ms_oracle_deepseek_probe.py, against ms_llm's
lowering of the same MindFormers YAML read by ms_llm's own converter (lower.py, lower_mla.py, lower_moe.py).

What can be compared, and how. MindFormers' training graph cannot be compiled on CPU, but it can be
built with the real degrees (the probe answers its rank / world-size / group questions as rank 0 of the
config), and each cell's shard() records its Layouts; those are read. Its primitives are not ours one to
one: its linears are Morph cells over (S, B, H) activations with the weight as an input, its RMSNorm is
the fused kernel, attention is always FlashAttentionScore. So each of our primitives is compared with
the MindFormers primitive that holds the same tensor, by what the strategies mean (which block of each
dimension every rank of a stage holds, the test's Blocks), after a view that lines up the dims:
  sbh          MindFormers' (S, B, X) as our (B, T, X);     sbh_tokens  ... as our flat (B*T, X);
  sbnd_bnsd    its (S, B, heads, d) as our (B, heads, T, d); sbnd_bsnd   ... as our (B, T, heads, d);
  deinterleave our rotary de-interleave transpose (B, heads, T, d/2, 2) as its strided slices (d whole);
  mf_tokens    its router tensors (groups = ranks, N/groups, ...) as our (N, ...);
  expert_weight our (E, F, H) expert weights as its grouped-GEMM (E*H, 2F) / (E*F, H): E blocks on dim 0.
Compared, per decoder layer (dense and MoE) and in the MTP module: every linear's input and weight (and
the row-parallel outputs), every norm, the q/k/v splits, both rotaries, the rotary key's tile, the q and k
concats, the attention core's q/k/v (our BatchMatMuls against FlashAttentionScore's inputs), the router
(linear, sigmoid, renormalisation, the expert-bias add, group-limited top-k, the gather of the scores,
the scaling), the routed experts' weights, the shared experts, the residual adds; beside them the
embedding, the final norm, lm_head, the loss and, with pipeline parallel, which stage holds each cell
(MTP with lm_head on the last).
Not comparable (no counterpart; NOT_OURS says which primitive): the dispatch (its dropless all-to-all permute /
unpermute vs our capacity dispatch, compared with MindFormers' own capacity MoE in ms_oracle_moe.py), its expert-load and balance-loss bookkeeping per
rank-local group vs our per-sequence loss and global loads, the softmax / score primitives inside its
fused kernel, its bias-add and SwiGLU split of fused weights, its token-shift of the MTP input ids (ours
shifts the embeddings), dropout.
Where MindFormers chooses otherwise, DEEPSEEK_CHOICES in the test names it and why we keep ours.
"""
from __future__ import annotations

import fnmatch

import yaml

# MindFormers 2.1 DeepseekV3Config: a DeepSeek-V3 in miniature with every DeepSeek field on (MLA with the
# query's low-rank path, sigmoid routing in groups with the expert bias, the sequence-wise balance loss, a
# shared expert, a dense first layer, one MTP module); 8 heads and 8 experts split by every degree below.
MODEL = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256,
         "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 8, "max_position_embeddings": 128, "seq_length": 64, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "position_embedding_type": "rope", "qk_layernorm": True,
         "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "num_nextn_predict_layers": 1, "mtp_loss_factor": 0.3,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "moe_router_score_function": "sigmoid", "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2,
         "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3, "moe_grouped_gemm": True,
         "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4, "n_shared_experts": 1,
         "moe_shared_expert_intermediate_size": 32, "first_k_dense_replace": 1, "params_dtype": "float32",
         "compute_dtype": "bfloat16"}
# name -> (MindFormers parallel_config, model_config overrides). MindFormers refuses MoE with tensor
# parallel but without sequence parallel ("performance may degrade"), so every tp case has
# use_seq_parallel; context parallel needs use_flash_attention (its MLA always runs the flash kernel).
CASES = {
    "ds_dp2_tp2_sp_ep2": ({"data_parallel": 2, "model_parallel": 2, "expert_parallel": 2, "use_seq_parallel": True},
                          {}),
    "ds_dp4_ep4": ({"data_parallel": 4, "expert_parallel": 4}, {}),
    "ds_dp2_tp2_sp_pp2_ep2": ({"data_parallel": 2, "model_parallel": 2, "expert_parallel": 2, "use_seq_parallel": True,
                               "pipeline_stage": 2, "micro_batch_num": 2}, {}),
    "ds_dp2_cp2_ep2": ({"data_parallel": 2, "context_parallel": 2, "expert_parallel": 2,
                        "context_parallel_algo": "colossalai_cp"}, {"use_flash_attention": True}),
}


def degrees(parallel: dict) -> tuple[int, int, int, int]:
    """(dp, tp, cp, pp)."""
    return (parallel.get("data_parallel", 1), parallel.get("model_parallel", 1), parallel.get("context_parallel", 1),
            parallel.get("pipeline_stage", 1))


def yaml_text(case: str) -> str:
    """The MindFormers 2.x YAML both sides read: MindFormers builds its model from it, ms_llm converts it."""
    parallel, model = CASES[case]
    return yaml.safe_dump({
        "use_legacy": False, "run_mode": "train", "use_parallel": True,
        "parallel": {"parallel_mode": 1, "full_batch": True, "enable_parallel_optimizer": False},
        "parallel_config": {"vocab_emb_dp": False, "micro_batch_num": 1, **parallel},
        "runner_config": {"batch_size": 1},
        "model": {"model_config": {**MODEL, **model}}})


# ---- views: MindFormers' (S, B, ...) / grouped tensors as ours ----------------------------------

def _sbh(mine, theirs):
    return mine, theirs.permute((1, 0, 2))


def _sbh_tokens(mine, theirs):
    return mine, theirs.permute((1, 0, 2)).merge(((0, 1), (2,)))


def _sbnd_bnsd(mine, theirs):
    return mine, theirs.permute((1, 2, 0, 3))


def _sbnd_bsnd(mine, theirs):
    return mine, theirs.permute((1, 0, 2, 3))


def _deinterleave(mine, theirs):
    return mine.merge(((0,), (1,), (2,), (3, 4))), theirs.permute((1, 2, 0, 3))


def _mf_tokens(mine, theirs):
    n = len(theirs.splits)
    return mine, theirs.merge(((0, 1),) + tuple((d,) for d in range(2, n)))


def _expert_weight(mine, theirs):
    return mine.merge(((0,), (1, 2))), theirs


VIEWS = {"sbh": _sbh, "sbh_tokens": _sbh_tokens, "sbnd_bnsd": _sbnd_bnsd, "sbnd_bsnd": _sbnd_bsnd,
         "deinterleave": _deinterleave, "mf_tokens": _mf_tokens, "expert_weight": _expert_weight}


# ---- pairs ---------------------------------------------------------------------------------------

def _norm(pair, ours: str, mf: str) -> list:
    """Our decomposed RMSNorm against MindFormers' fused RmsNorm(x, gamma)."""
    out = [pair(ours + ".mul2", mf + ".norm", ((ours + ".square", 0), (ours + ".mul2", 1)), ("sbh", None))]
    return out + [pair(f"{ours}.{p}", mf + ".norm", ((f"{ours}.{p}", 0),), ("sbh",)) for p in ("mean", "rsqrt", "add")]


def _linear(pair, ours: str, mf: str, out: bool = False) -> list:
    """Our Linear's MatMul (tokens, weight) against MindFormers' Morph linear ((S, B, in), weight)."""
    return [pair(ours + ".matmul", mf + ".morphed_forward", ((ours + ".matmul", 0), (ours + ".matmul", 1)),
                 ("sbh_tokens", None), out)]


def _rotary(pair, ours: str, mf: str) -> list:
    """Our DecoupledRotary against MindFormers' ApplyRotaryPosEmb (interleaved: strided slices)."""
    r = ours + ".rotary."
    one = (("sbnd_bnsd",), ("sbnd_bnsd", "sbnd_bnsd"))
    return [pair(ours + ".transpose", mf + ".slice", ((ours + ".transpose", 0),), ("deinterleave",)),
            pair(ours + ".transpose", mf + ".strideslice", ((ours + ".transpose", 0),), ("deinterleave",)),
            pair(r + "split", mf + ".split", ((r + "split", 0),), one[0]),
            pair(r + "neg", mf + ".neg", ((r + "neg", 0),), one[0]),
            pair(r + "concat", mf + ".cat", ((r + "concat", 0), (r + "concat", 1)), one[1]),
            pair(r + "add", mf + ".add", ((r + "add", 0), (r + "add", 1)), one[1]),
            # the rotated tensor; the tables (ours (T, d), its (S, 1, 1, d)) are whole but for cp in both
            pair(r + "mul_cos", mf + ".mul", ((r + "mul_cos", 0),), one[0]),
            pair(r + "mul_sin", mf + ".mul", ((r + "mul_sin", 0),), one[0])]


def _attention(pair, o: str, m: str, cp: int) -> list:
    s, a = o + "self_attn.", m + "self_attention."
    out = (_linear(pair, s + "q_a_proj", a + "linear_qkv") + _linear(pair, s + "kv_a_proj_with_mqa", a + "linear_qkv")
           + _norm(pair, s + "q_a_layernorm", a + "q_layernorm") + _norm(pair, s + "kv_a_layernorm", a + "k_layernorm")
           + _linear(pair, s + "q_b_proj", a + "linear_qb") + _linear(pair, s + "kv_b_proj", a + "linear_kvb")
           + _linear(pair, s + "o_proj", a + "linear_proj", out=True)
           + _rotary(pair, s + "rotary_q", a + "apply_rotary_emb") + _rotary(pair, s + "rotary_k", a + "apply_rotary_emb2"))
    both = ("sbnd_bnsd", "sbnd_bnsd")
    out += [pair(s + "transpose_q", a + "split", ((s + "transpose_q", 0),), ("sbnd_bsnd",)),
            pair(s + "transpose_kv", a + "split", ((s + "transpose_kv", 0),), ("sbnd_bsnd",)),
            pair(s + "slice", a + "split", ((s + "slice", 0),), ("sbnd_bnsd",)),
            pair(s + "tile_k", a + "tile_kv", ((s + "tile_k", 0),), ("sbnd_bnsd",)),
            pair(s + "concat_q", a + "pe_concat", ((s + "concat_q", 0), (s + "concat_q", 1)), both),
            pair(s + "concat_k", a + "pe_concat", ((s + "concat_k", 0), (s + "concat_k", 1)), both)]
    # the attention core: our BatchMatMuls' q, k, v against FlashAttentionScore's (BNSD; BSH under cp)
    core = ("bsh",) * 3 if cp > 1 else ()
    out.append(pair(s + "batch_matmul_q_k", a + "core_attention.flash_attention",
                    ((s + "batch_matmul_q_k", 0), (s + "batch_matmul_q_k", 1), (s + "batch_matmul", 1)), core))
    return out


def _moe(pair, o: str, m: str) -> list:
    p, r = o + "mlp.", m + "mlp.router."
    tok = ("mf_tokens",)
    out = [pair(p + "gate.matmul", r + "linear", ((p + "gate.matmul", 0), (p + "gate.matmul", 1)), ("mf_tokens", None)),
           pair(p + "sigmoid", r + "gating_activation", ((p + "sigmoid", 0),), tok),
           pair(p + "sum_scores", r + "reduce_sum_keep", ((p + "sum_scores", 0),), tok),
           pair(p + "div_scores", r + "div_3d", ((p + "div_scores", 0), (p + "div_scores", 1)), tok * 2),
           pair(p + "sum_top", r + "reduce_sum_keep", ((p + "sum_top", 0),), tok),
           pair(p + "div", r + "div_3d", ((p + "div", 0), (p + "div", 1)), tok * 2),
           pair(p + "add_bias", r + "afb_add_topk_bias", ((p + "add_bias", 0), (p + "add_bias", 1)), ("mf_tokens", None)),
           pair(p + "limit_groups.topk", r + "tc_topk", ((p + "limit_groups.topk", 0),), tok),
           pair(p + "limit_groups.sum", r + "tc_sum", ((p + "limit_groups.sum", 0),), tok),
           pair(p + "limit_groups.topk_groups", r + "topk", ((p + "limit_groups.topk_groups", 0),), tok),
           pair(p + "topk", r + "topk", ((p + "topk", 0),), tok),
           pair(p + "gather", r + "gate_gather", ((p + "gather", 0), (p + "gather", 1), (p + "gather", 2)),
                ("mf_tokens", None, "mf_tokens")),
           pair(p + "mul_scaling", r + "mul", ((p + "mul_scaling", 1), (p + "mul_scaling", 0)), (None, "mf_tokens")),
           # the grouped GEMM's weights: w1 (gate and up of every expert), w2 (down); its tokens are the
           # all-to-all's, not comparable
           pair(p + "experts.bmm_gate", m + "mlp.experts.morphed_forward", ((p + "experts.bmm_gate", 1),),
                ("expert_weight",), index=(3,)),
           pair(p + "experts.bmm_down", m + "mlp.experts.morphed_forward", ((p + "experts.bmm_down", 1),),
                ("expert_weight",), index=(4,)),
           pair(p + "add", m + "mlp.add", ((p + "add", 0), (p + "add", 1)), ("sbh", "sbh"))]
    sh, msh = p + "shared_experts.", m + "mlp.shared_experts."
    out += _linear(pair, sh + "gate_proj", msh + "linear_fc1") + _linear(pair, sh + "up_proj", msh + "linear_fc1")
    out += _linear(pair, sh + "down_proj", msh + "linear_fc2", out=True)
    return out


def layer_pairs(pair, o: str, m: str, moe: bool, cp: int) -> list:
    """Our decoder layer `o` (model.layers.N. / model.mtp.D.layer.) against MindFormers' `m`
    (model.decoder.layers.N. / model.mtp.layers.D.transformer_layer.)."""
    out = _norm(pair, o + "input_layernorm", m + "input_layernorm") + _attention(pair, o, m, cp)
    out += [pair(o + "add", m + "add", ((o + "add", 0), (o + "add", 1)), ("sbh", "sbh"))]
    out += _norm(pair, o + "post_attention_layernorm", m + "pre_mlp_layernorm")
    if moe:
        return out + _moe(pair, o, m)
    f, mf = o + "mlp.", m + "mlp."
    return (out + _linear(pair, f + "gate_proj", mf + "linear_fc1") + _linear(pair, f + "up_proj", mf + "linear_fc1")
            + _linear(pair, f + "down_proj", mf + "linear_fc2", out=True)
            # silu(gate) * up: ours sigmoid and two Muls, its SiLU and Mul, all on (tokens, ffn) split over tp
            + [pair(f + "sigmoid", mf + "activation_func.silu", ((f + "sigmoid", 0),), ("sbh",)),
               pair(f + "silu_mul", mf + "activation_func.silu", ((f + "silu_mul", 0),), ("sbh",)),
               pair(f + "mul", mf + "mul", ((f + "mul", 0), (f + "mul", 1)), ("sbh", "sbh"))])


def pairs(pair, parallel: dict) -> list:
    """Every primitive of ours with a MindFormers counterpart in this case."""
    cp = degrees(parallel)[2]
    moe = [i >= MODEL["first_k_dense_replace"] for i in range(MODEL["num_hidden_layers"] + 1)]
    out = [pair("model.embed_tokens.gather", "model.embedding.word_embeddings.embedding_morph",
                (("model.embed_tokens.gather", 1), ("model.embed_tokens.gather", 0)), ())]
    for i in range(MODEL["num_hidden_layers"]):
        out += layer_pairs(pair, f"model.layers.{i}.", f"model.decoder.layers.{i}.", moe[i], cp)
    out += _norm(pair, "model.norm", "model.decoder.final_layernorm")
    out += _linear(pair, "lm_head", "model.output_layer")
    ls, nll = "model.loss._log_softmax.", "model.loss._nllloss."
    for ours, mf, n in (("max", ls + "max", 1), ("sub", ls + "sub", 2), ("exp", ls + "exp", 1), ("sum", ls + "sum", 1),
                        ("log", ls + "log", 1), ("sub2", ls + "sub", 2), ("onehot", ls + "onehot", 3),
                        ("mul", nll + "mul", 2), ("neg", nll + "neg", 1), ("sum2", nll + "sum", 1)):
        out.append(pair("loss." + ours, mf, tuple(("loss." + ours, k) for k in range(n)), ()))
    d, md = "model.mtp.0.", "model.mtp.layers.0."
    out += _norm(pair, d + "enorm", md + "enorm") + _norm(pair, d + "hnorm", md + "hnorm")
    out += [pair(d + "concat", md + "concat", ((d + "concat", 0), (d + "concat", 1)), ("sbh", "sbh"))]
    out += _linear(pair, d + "eh_proj", md + "eh_proj")
    out += layer_pairs(pair, d + "layer.", md + "transformer_layer.", moe[-1], cp)
    out += _norm(pair, d + "norm", md + "final_layernorm")
    out += _linear(pair, "lm_head", "model.mtp.output_layer")
    return out


# Cells whose pipeline stage both sides set: ours -> MindFormers'.
STAGE_CELLS = {"model.embed_tokens": "model.embedding", "model.layers.0": "model.decoder.layers.0",
               "model.layers.1": "model.decoder.layers.1", "model.norm": "model.decoder.final_layernorm",
               "lm_head": "model.output_layer", "model.mtp.0": "model.mtp"}

# MindFormers primitives of a decoder layer (short name after the layer prefix) or of the MTP module that
# have no counterpart of ours, and why (the module docstring's groups).
NOT_OURS = {
    "*.morphed_forward_with_bias": "the linears' bias path; no linear has a bias in DeepSeek-V3, the bias-free "
                                   "morphed_forward is compared",
    "self_attention.bs_transpose": "(B, S, H) <-> (S, B, H) around its attention; ours is (B, T, H) throughout",
    "self_attention.tnd_transpose*": "the TND layout for EOD-compressed masks (use_eod_attn_mask_compression), off",
    "self_attention.split_3d": "one split of its concatenated down-projection (q latent, kv latent, rotary key); "
                               "ours has two down-projections, both compared with linear_qkv",
    "self_attention.core_attention.*_transpose": "layout changes inside its flash-attention cell; ours has none",
    "self_attention.apply_rotary_emb*.cos": "the rotary tables computed in the layer; ours are built once, whole",
    "self_attention.apply_rotary_emb*.sin": "the rotary tables computed in the layer; ours are built once, whole",
    "self_attention.apply_rotary_emb*.mul_mscale": "YaRN's mscale on the tables; ours folds it into the tables",
    "hidden_states_dropout.dropout": "dropout, 0 in training here; ours has none",
    "add_bias": "a residual bias add, unused without biases",
    "mlp.split": "the split of the dense MLP's fused, interleaved w1/w3 output (ours are two matmuls)",
    "mlp.add": "the dense MLP's bias add, unused without biases (the MoE layer's, routed + shared, is compared)",
    "mlp.shared_experts.activation_func.*": "the shared experts' SiLU on their fused w1/w3 output",
    "mlp.shared_experts.split": "the split of the shared experts' fused w1/w3 output",
    "mlp.shared_experts.mul": "the shared experts' gate x up",
    "mlp.shared_experts.add": "the shared experts' bias add, unused without biases",
    "mlp.local_reshape_permute": "dispatch: each rank's tokens regrouped for the all-to-all",
    "mlp.local_reshape_unpermute": "dispatch: the combine's inverse regrouping",
    "mlp.transpose": "dispatch: (S, B, H) -> (B, S, H) before the regrouping",
    "mlp.transpose2": "dispatch: back to (S, B, H)",
    "mlp.router.afb_topk": "the biased top-k without groups; with groups its topk serves both, compared",
    "mlp.router.assign_add": "expert-load bookkeeping per step (TopkBiasBalanceCallback); ours sums the loads",
    "mlp.router.onehot_2d": "expert-load bookkeeping: the chosen experts one-hot per rank-local group",
    "mlp.router.reduce_mean": "expert-load bookkeeping per rank-local group",
    "mlp.router.afb_reduce_mean": "expert-load bookkeeping over the groups",
    "mlp.router.reduce_mean_aux_*": "the balance loss per rank-local token group; ours is per sequence",
    "mlp.router.mul_aux_2d": "the balance loss per rank-local token group; ours is per sequence",
    "mlp.router.onehot_aux": "the balance loss per rank-local token group; ours is per sequence",
    "mlp.router.add_loss": "the balance loss per rank-local token group; ours is per sequence",
    "mlp.router.reduce_mean_sp": "seq_aux_loss: f averaged over the tp ranks' sequence chunks",
    "mlp.router.mul_sp": "seq_aux_loss: f averaged over the tp ranks' sequence chunks",
    "mlp.router.*_dp": "gbs_aux_loss, off",
    "mlp.router.assignadd": "gbs_aux_loss's accumulator, off",
    "mlp.router.div": "gbs_aux_loss, off",
    "mlp.router.*_accu": "gbs_aux_loss's accumulator, off",
    "mlp.router.add_eps": "the 1e-20 of its renormalisation; ours adds it outside a primitive",
    "eh_proj.matmul": "the MTP projection's sharding-propagation MatMul, unused in semi_auto_parallel; its "
                      "morphed_forward is compared",
}


def explained(short: str) -> str | None:
    """The NOT_OURS entry that explains MindFormers primitive `short`, None if none does."""
    return next((g for g in NOT_OURS if fnmatch.fnmatchcase(short, g)), None)
