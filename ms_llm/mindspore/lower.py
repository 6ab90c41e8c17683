"""Lower a ModelPlan to MindSpore auto-parallel: context, op shard strategies, stages, recompute.

Nothing here is a table of strategies. Every op's strategy is read off the plan's layouts:
a Linear's input is its activation layout flattened to (tokens, in), its weight is the
parameter's layout, a row-parallel output lands in the residual stream's layout (so
sequence parallel turns the all-reduce into a reduce-scatter), attention ops take the
q/k/v layouts transposed to (B, heads, T, hd) with keys whole along the sequence (context
parallel: allgather, ulysses or ring, MindFormers' colossalai_cp / ulysses_cp /
use_ring_attention, _attention_core). For the
cases MindFormers covers the results equal the strategies of MindFormers' own LLaMA, built and
read by tests/mindspore/test_ms_oracle.py, which also lists where MindFormers chooses otherwise and why.
Multi-latent attention is lowered by lower_mla.py, MoE layers by lower_moe.py (experts over ep, their
tokens over edp). The multi-token prediction modules (model.mtp.{d}) run with lm_head on the last
model chunk, their decoder layers lowered as the main ones; they read the main embedding's output,
which the pipeline carries from the first stage (the plan's embedding copy is the torch backend's way).

A strategy is a tuple of split counts when MindSpore's default device matrix for it (split
dims in tensor order, replicas innermost) puts the ranks where the mesh does; otherwise
(context parallel after the heads transpose) it is a Layout over the named stage mesh.
Computing the lowering imports no MindSpore (`ms-llm train --dry-run` prints it without
compiling); applying it is apply.py, writing strategy files needs MindSpore's protobuf.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ms_llm.errors import StrategyError
from ms_llm.mindspore import lower_mla
from ms_llm.mindspore.layout import parallel_optimizer_layout
from ms_llm.mindspore.lower_moe import moe_ops
from ms_llm.mindspore.op_strategy import OpShard, flat_tokens, norm_ops, op_shard, reshaped, select
from ms_llm.strategy.layout import Replicate, Shard, TensorLayout
from ms_llm.strategy.cost import cp_algorithm as priced_cp_algorithm
from ms_llm.strategy.devices import DEVICES
from ms_llm.strategy.plan import ModelPlan

# Our pipeline schedule -> MindSpore pipeline_config (MindSpore allows only 1f1b without interleave).
SCHEDULES = {"1f1b": (False, "1f1b"), "interleaved_1f1b": (True, "1f1b"), "gpipe": (True, "gpipe"),
             "zbv": (True, "zero_bubble_v")}
MODES = {"semi_auto": "semi_auto_parallel", "auto": "auto_parallel"}


def _one_head(score: TensorLayout) -> TensorLayout:
    """The (B, 1, T, T) flash-attention mask beside a (B, heads, T, T) score: split like its rows."""
    b, _, t, s = score.shape
    placements = tuple(Replicate() if p == Shard(1) else p for p in score.placements)
    return TensorLayout((b, 1, t, s), score.mesh, placements, score.order)


@dataclass(frozen=True)
class Lowering:
    plan: ModelPlan
    context: dict                              # ms.set_auto_parallel_context(**context)
    ops: tuple[OpShard, ...]
    cell_stages: dict[str, tuple[int, int]]    # cell path -> (pipeline_stage, pipeline_segment)
    recompute_cells: tuple[str, ...]
    recompute_ops: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())


def context_args(plan: ModelPlan, mode: str = "semi_auto", strategy_file: str = "strategy/ckpt_strategy.ckpt") -> dict:
    """set_auto_parallel_context arguments for this plan."""
    if mode not in MODES:
        raise StrategyError(f"lowering mode {mode!r}: use one of {', '.join(MODES)}")
    s = plan.strategy
    batch_split = plan.activations["tokens"].split_count(0)
    ctx = {
        "parallel_mode": MODES[mode],
        "device_num": plan.world_size,
        "gradients_mean": False,               # the graph's loss is already the global mean
        "full_batch": False,
        "dataset_strategy": ((batch_split, 1), (batch_split, 1)),   # (inputs, labels): whole sequences per rank
        "strategy_ckpt_config": {"save_file": strategy_file, "only_trainable_params": True},
        "enable_parallel_optimizer": plan.zero.stage >= 1,
    }
    if s.ep > 1:       # the MoE dispatch's layout changes over ep become all-to-alls (lower_moe.py)
        ctx["enable_alltoall"] = True
    if plan.zero.stage >= 1:
        ctx["parallel_optimizer_config"] = {"optimizer_level": f"level{plan.zero.stage}",
                                            "optimizer_weight_shard_size": optimizer_shard_size(plan),
                                            "parallel_optimizer_threshold": 0}
    if s.pp > 1:
        if s.pipeline.schedule not in SCHEDULES:
            raise StrategyError(f"strategy.pipeline.schedule: MindSpore has no {s.pipeline.schedule!r} scheduler; "
                                f"use one of {', '.join(SCHEDULES)}")
        interleave, scheduler = SCHEDULES[s.pipeline.schedule]
        ctx["pipeline_stages"] = s.pp
        ctx["pipeline_config"] = {"pipeline_interleave": interleave, "pipeline_scheduler": scheduler}
    if mode == "auto":
        ctx["search_mode"] = "sharding_propagation"
    return ctx


def optimizer_shard_size(plan: ModelPlan) -> int:
    """MindSpore's optimizer_weight_shard_size. It is one number for every parameter: each is split
    over that many of the ranks holding the same slice of it (consecutive ones, in rank order), or
    over all of them at -1, and left whole where the number does not divide them. The dense
    parameters' ZeRO group (dp_shard x cp), unless the routed experts, held alike by their edp ranks,
    need another: then -1, as MindFormers' MoE configs leave it, which splits each expert weight over
    its edp and, with ZeRO over all of dp x cp (support.py refuses hybrid sharding here), each dense
    tensor-parallel weight over the same ranks as the dense group would."""
    experts = plan.expert_zero.group_size if plan.expert_zero is not None else 1
    return plan.zero.group_size if experts in (1, plan.zero.group_size) else -1


def parallel_optimizer_plan(plan: ModelPlan) -> ModelPlan:
    """The plan with each parameter's ZeRO layout where MindSpore's parallel optimizer puts it
    (layout.parallel_optimizer_layout at optimizer_shard_size): what a compiled step's optimizer
    states (and ZeRO-3 weights) hold on each rank, so what its checkpoints and strategy files name.
    The same as the plan's data-parallel split for every weight tensor parallelism splits; a weight
    every tp rank holds whole (norms, router, biases) MindSpore splits over ranks in rank order, tp
    among them, and a weight whose dimension 0 does not divide it stays whole."""
    if plan.zero.stage == 0:
        return plan
    size = optimizer_shard_size(plan)
    params = {n: replace(p, zero_layout=parallel_optimizer_layout(p.layout, size), zero_stage=plan.zero.stage)
              for n, p in plan.params.items()}
    return replace(plan, params=params)


# Context-parallel algorithms this lowering emits, as MindFormers 2.1's LLaMA does for
# context_parallel_algo colossalai_cp (allgather), ulysses_cp (ulysses) and use_ring_attention
# (ring: FlashAttentionScore with enable_ring_attention, which only its flash path has).
CP_ALGORITHMS = ("allgather", "ulysses", "ring")
# What MindFormers' FlashAttention adds to FlashAttentionScore for ring attention: MindSpore's
# parallel pass then passes K/V blocks around the cp group by send/recv and masks each step.
RING_ATTRS = (("enable_ring_attention", True), ("enable_ra_send_recv", True))


def flash_attention(plan: ModelPlan) -> bool:
    """The model's attention holds FlashAttentionScore (model.uses_flash_attention without the device
    check): multi-latent attention never does, its q/k and v widths differ."""
    return plan.model.flash_attention and plan.model.mla is None


def _ulysses_fits(plan: ModelPlan) -> bool:
    """MindFormers' ulysses_cp splits query and kv heads over mp*cp, repeating none."""
    s, m = plan.strategy, plan.model
    return m.num_heads % (s.tp * s.cp) == 0 and m.num_kv_heads % (s.tp * s.cp) == 0


def cp_algorithm(plan: ModelPlan) -> str:
    """The context-parallel algorithm lowered; 'auto' = the cost model's pick on a 910B among
    those this lowering emits for the model."""
    runs = tuple(a for a in CP_ALGORITHMS if (a != "ulysses" or _ulysses_fits(plan))
                 and (a != "ring" or flash_attention(plan)))
    return priced_cp_algorithm(plan, DEVICES["910b"], runs)


def ring_attention(plan: ModelPlan) -> bool:
    """Flash attention runs as ring attention: it is called without a mask (the parallel pass
    masks each ring step itself), as MindFormers calls it with use_ring_attention."""
    return plan.strategy.cp > 1 and cp_algorithm(plan) == "ring"


def cp_refusals(plan: ModelPlan) -> list[str]:
    """Why this lowering cannot emit the plan's context parallelism (empty: it can)."""
    s, algorithm = plan.strategy, plan.strategy.context_parallel.algorithm
    field = "strategy.context_parallel.algorithm"
    if algorithm == "ring" and plan.model.mla is not None:
        return [f"{field}: ring on MindSpore is FlashAttentionScore's ring attention, which multi-latent "
                "attention does not run (its q/k and v widths differ); use allgather or ulysses"]
    if algorithm == "ring" and not plan.model.flash_attention:
        return [f"{field}: ring on MindSpore is FlashAttentionScore's ring attention (MindFormers' "
                "use_ring_attention needs use_flash_attention too); set model.flash_attention: true, or use "
                "allgather or ulysses"]
    if algorithm == "ulysses" and not _ulysses_fits(plan):
        return [f"{field}: ulysses on MindSpore splits query and kv heads over tp*cp = {s.tp * s.cp}, "
                f"model.num_kv_heads = {plan.model.num_kv_heads} does not divide (MindFormers' ulysses_cp asks "
                "the same); use allgather"]
    return []


def _heads_over_cp(layout: TensorLayout) -> TensorLayout:
    """(B, heads, T, hd) split on T over cp -> split on heads over cp (cp major, tp minor, as
    MindFormers' (dp, 1, cp*mp)); MindSpore's redistribution between the two is Ulysses' all-to-all."""
    placements = list(layout.placements)
    placements[layout.mesh.names.index("cp")] = Shard(1)
    return TensorLayout(layout.shape, layout.mesh, tuple(placements), layout.order)


def _attention_core(plan: ModelPlan, qt: TensorLayout, kt: TensorLayout, vt: TensorLayout):
    """(q, k, v, score) layouts around the attention core, (B, heads, T, hd) and (B, heads, T, T);
    the core reads k and v whole along the sequence.

    Context parallel, as MindFormers 2.1's LLaMA builds it for the same context_parallel_algo:
      allgather (colossalai_cp): queries keep their cp split of the sequence, keys and values
                   are whole along it (all-gathered over cp); score rows split like q.
      ulysses (ulysses_cp): heads split over cp*tp, the sequence whole (FlashAttention
                   (dp, 1, cp*mp) in BSH).
      ring (use_ring_attention): as allgather; only flash attention differs (_layer_ops).
    Without cp all are the plain layouts."""
    b, nh, t, _ = qt.shape
    if plan.strategy.cp > 1 and cp_algorithm(plan) == "ulysses":
        qt, kt, vt = _heads_over_cp(qt), _heads_over_cp(kt), _heads_over_cp(vt)
    score = TensorLayout((b, nh, t, t), qt.mesh, qt.placements, qt.order)    # query rows keep q's splits
    return qt, kt, vt, score


def _gqa_ops(plan: ModelPlan, p: str, qt: TensorLayout, kt: TensorLayout, core) -> list[OpShard]:
    """Grouped-query attention's primitives (model.Attention) in decoder layer `p`."""
    a, w = plan.activations, {n: q.layout for n, q in plan.params.items() if n.startswith(p)}
    q_core, k_core, v_core, score = core
    k_all, v_all = k_core.replicate_dim(2), v_core.replicate_dim(2)          # every key of the sequence
    kv_tiled = k_core.group_dims(((0,), (1,), (), (2, 3)))                   # (B, nkv, 1, T*hd)
    tables = select(qt, (2, 3))                                              # rotary cos/sin (T, hd)
    ops = []
    for proj, out in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        ops.append(op_shard(f"{p}self_attn.{proj}.matmul", [flat_tokens(a["attn_input"]), w[f"{p}self_attn.{proj}.weight"]]))
        if plan.model.qkv_bias:      # (tokens, heads * hd) + bias, both split over the heads like the weight rows
            ops.append(op_shard(f"{p}self_attn.{proj}.bias_add", [a[out].group_dims(((0, 1), (2, 3))),
                                                             w[f"{p}self_attn.{proj}.bias"]]))
    if plan.model.qk_norm:           # over each head's features of (B, T, heads, hd); the weight is replicated
        for norm, out in (("q_norm", "q"), ("k_norm", "k")):
            ops += norm_ops(f"{p}self_attn.{norm}.", a[out], w[f"{p}self_attn.{norm}.weight"])
    r = p + "self_attn.rotary."
    ops += [op_shard(p + "self_attn.transpose", [a["q"]]),
            op_shard(r + "split", [qt]), op_shard(r + "neg", [qt]), op_shard(r + "concat", [qt, qt]),
            op_shard(r + "mul_cos", [qt, tables]), op_shard(r + "mul_sin", [qt, tables]), op_shard(r + "add", [qt, qt]),
            op_shard(p + "self_attn.tile_kv", [kv_tiled]),
            op_shard(p + "self_attn.batch_matmul_q_k", [q_core, k_all]),
            op_shard(p + "self_attn.mul", [score, None]),
            op_shard(p + "self_attn.add", [select(score, (2, 3)), score]),
            op_shard(p + "self_attn.softmax", [score]),
            op_shard(p + "self_attn.batch_matmul", [score, v_all]),
            op_shard(p + "self_attn.merge_heads", [qt]),
            op_shard(p + "self_attn.o_proj.matmul", [flat_tokens(a["attn_output"]), w[p + "self_attn.o_proj.weight"]],
                flat_tokens(a["hidden"]))]
    if plan.model.flash_attention and ring_attention(plan):
        # Ring attention: k/v keep their cp split of the sequence like q (the pass moves the blocks),
        # and there is no mask input. MindFormers: (dp, cp, mp) for q, k and v.
        ops.append(op_shard(p + "self_attn.flash_attention", [q_core, k_core, v_core], attrs=RING_ATTRS))
    elif plan.model.flash_attention:
        # FlashAttentionScore (BNSD): q, k, v as the BatchMatMul path reads them (keys whole along the
        # sequence), k/v with their own kv heads (the kernel serves GQA), the mask split like score rows.
        ops.append(op_shard(p + "self_attn.flash_attention", [q_core, k_all, v_all, _one_head(score)]))
    return ops


def _layer_ops(plan: ModelPlan, p: str, moe: bool) -> list[OpShard]:
    """Every primitive of the decoder layer at `p` (model.layers.N. or model.mtp.D.layer.)."""
    a, w = plan.activations, {n: q.layout for n, q in plan.params.items() if n.startswith(p)}
    hidden = a["hidden"]
    qt, kt, vt = (a[n].permute((0, 2, 1, 3)) for n in ("q", "k", "v"))      # (B, heads, T, hd)
    core = _attention_core(plan, qt, kt, vt)
    ops = norm_ops(p + "input_layernorm.", hidden, w[p + "input_layernorm.weight"])
    if plan.model.mla is not None:
        ops += lower_mla.mla_ops(plan, p, qt, kt, vt, core)
    else:
        ops += _gqa_ops(plan, p, qt, kt, core)
    ops.append(op_shard(p + "add", [hidden, hidden]))
    ops += norm_ops(p + "post_attention_layernorm.", hidden, w[p + "post_attention_layernorm.weight"])
    if moe:
        return ops + moe_ops(plan, p)
    mh = a["mlp_hidden"]
    ops += [op_shard(f"{p}mlp.{proj}.matmul", [flat_tokens(a["mlp_input"]), w[f"{p}mlp.{proj}.weight"]])
            for proj in ("gate_proj", "up_proj")]
    ops += [op_shard(p + "mlp.sigmoid", [mh]), op_shard(p + "mlp.silu_mul", [mh, mh]), op_shard(p + "mlp.mul", [mh, mh]),
            op_shard(p + "mlp.down_proj.matmul", [flat_tokens(mh), w[p + "mlp.down_proj.weight"]], flat_tokens(hidden))]
    return ops


def _mtp_ops(plan: ModelPlan) -> list[OpShard]:
    """The MTP modules (mtp.MTPModule): enorm(embedding shifted by k) and hnorm(h_{k-1}) in the residual
    stream's layout, their concat, eh_proj column-parallel over them gathered over tp (the plan's
    mtp_proj; its output is gathered over tp into the layer's residual stream, as Megatron-core's
    MultiTokenPredictionLayer), the decoder layer, the norm before the shared lm_head. The shift
    concatenates along the sequence, so it reads the sequence whole."""
    a, w, m = plan.activations, {n: q.layout for n, q in plan.params.items()}, plan.model
    hidden = a["hidden"]
    b, t, h = hidden.shape
    pair = reshaped(a["attn_input"], (b, t, 2 * h))
    whole_seq = hidden.replicate_dim(1)
    ops = []
    for d in range(m.mtp_layers):
        p = f"model.mtp.{d}."
        ops += [op_shard(p + "concat_shift", [whole_seq, whole_seq])]
        ops += norm_ops(p + "enorm.", hidden, w[p + "enorm.weight"]) + norm_ops(p + "hnorm.", hidden, w[p + "hnorm.weight"])
        ops += [op_shard(p + "concat", [hidden, hidden]),
                op_shard(p + "eh_proj.matmul", [flat_tokens(pair), w[p + "eh_proj.weight"]])]
        ops += _layer_ops(plan, p + "layer.", m.is_moe_layer(m.num_layers + d))
        ops += norm_ops(p + "norm.", hidden, w[p + "norm.weight"])
    return ops


def _head_ops(plan: ModelPlan) -> list[OpShard]:
    a, params = plan.activations, plan.params
    head = params["model.embed_tokens.weight" if plan.model.tie_embeddings else "lm_head.weight"].layout
    logits = flat_tokens(a["logits"])                      # (tokens, vocab)
    rows = logits.replicate_dim(1)                   # per-token reductions
    labels = select(logits, (0,))
    ops = norm_ops("model.norm.", a["hidden"], params["model.norm.weight"].layout)
    ops.append(op_shard("lm_head.matmul", [flat_tokens(a["head_input"]), head]))
    ops += [op_shard("loss.max", [logits]), op_shard("loss.sub", [logits, rows]), op_shard("loss.exp", [logits]),
            op_shard("loss.sum", [logits]), op_shard("loss.log", [rows]), op_shard("loss.sub2", [logits, rows]),
            op_shard("loss.onehot", [logits, None, None]), op_shard("loss.mul", [logits, logits]),
            op_shard("loss.neg", [logits]), op_shard("loss.sum2", [logits]), op_shard("loss.mean", [labels])]
    return ops


SELECTIVE_OPS = ("self_attn.tile_kv", "self_attn.batch_matmul_q_k", "self_attn.mul", "self_attn.add",
                 "self_attn.softmax", "self_attn.batch_matmul")
SELECTIVE_CELLS = ("self_attn.rotary",)
SELECTIVE_MLP = ("mlp.sigmoid", "mlp.silu_mul")


def _selective(plan: ModelPlan, layer: int) -> tuple[list[str], list[str]]:
    """(cells, primitives) selective recompute keeps in `layer`: the attention core with its rotary
    and the SwiGLU activation (the experts' in an MoE layer)."""
    mla = plan.model.mla is not None
    cells = lower_mla.SELECTIVE_CELLS if mla else SELECTIVE_CELLS
    mlp = tuple(o.replace("mlp.", "mlp.experts.", 1) for o in SELECTIVE_MLP) if plan.model.is_moe_layer(layer) \
        else SELECTIVE_MLP
    ops = (lower_mla.SELECTIVE_OPS if mla else SELECTIVE_OPS) + mlp
    p = f"model.layers.{layer}."
    return [p + c for c in cells], [p + o for o in ops]


def lower(plan: ModelPlan, mode: str = "semi_auto", strategy_file: str = "strategy/ckpt_strategy.ckpt") -> Lowering:
    """Everything MindSpore needs to run `plan` under auto-parallel."""
    if plan.strategy.cp > 1 and cp_refusals(plan):
        raise StrategyError(cp_refusals(plan))
    m = plan.model
    embed = plan.params["model.embed_tokens.weight"].layout
    ops = [op_shard("model.embed_tokens.gather", [embed, plan.activations["tokens"]])]
    if flash_attention(plan):           # the (1, 1, T, T) causal mask tiled to the batch, whole on every rank
        t = plan.train.seq_len
        ops.append(op_shard("mask_tile", [TensorLayout.replicated((1, 1, t, t), plan.stage_mesh)]))
    for i in range(m.num_layers):
        ops += _layer_ops(plan, f"model.layers.{i}.", m.is_moe_layer(i))
    ops += _head_ops(plan) + _mtp_ops(plan)
    if m.moe is not None and m.moe.expert_bias:      # each biased layer's expert loads (E,), whole on every rank
        biased = [n for n in plan.buffers if n.endswith("e_score_correction_bias")]
        ops.append(op_shard("stack_loads", [TensorLayout.replicated((m.moe.num_experts,), plan.stage_mesh)] * len(biased)))

    first, last = plan.chunks[0], plan.chunks[-1]
    stages = {"model.embed_tokens": (first.stage, first.virtual)}
    for i in range(m.num_layers):
        stages[f"model.layers.{i}"] = plan.layer_stage(i)
    for cell in ("model.norm", "lm_head", "loss") + tuple(f"model.mtp.{d}" for d in range(m.mtp_layers)):
        stages[cell] = (last.stage, last.virtual)

    cells, prims = [], []
    for i, mode_i in enumerate(plan.recompute):
        if mode_i == "full":
            cells.append(f"model.layers.{i}")
        elif mode_i == "selective":
            layer_cells, layer_prims = _selective(plan, i)
            cells += layer_cells
            prims += layer_prims

    notes = []
    s = plan.strategy
    if s.offload.optimizer or s.offload.params:
        notes.append("offload: not lowered; MindSpore's offload is set per cell with AutoParallel.offload")
    return Lowering(plan, context_args(plan, mode, strategy_file), tuple(ops), stages, tuple(cells), tuple(prims),
                    tuple(notes))


def stage_param_entries(plan: ModelPlan, stage: int) -> dict:
    """Strategy-file entry (MsParamLayout) of each parameter of a stage, held as MindSpore's
    parallel optimizer holds it (ZeRO-split where a strategy file can say so), with the layout
    of the slices a per-rank checkpoint under that entry holds."""
    from ms_llm.mindspore.strategy_file import ms_param_layout

    return {p.name: ms_param_layout(p.layout, p.optimizer_layout)
            for p in parallel_optimizer_plan(plan).params_of_stage(stage)}


def write_strategy_files(plan: ModelPlan, folder: str | Path) -> list[Path]:
    """One strategy checkpoint per rank, named as MindFormers names them (ckpt_strategy_rank_{rank}.ckpt):
    what MindSpore would save through strategy_ckpt_config, which it cannot compile on CPU."""
    from ms_llm.mindspore.strategy_file import write_strategy_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {s: {n: e for n, (e, _) in stage_param_entries(plan, s).items()} for s in range(plan.strategy.pp)}
    splits = {p.name: p.layout.ms_strategy() for p in plan.params.values()}
    paths = []
    for rank in range(plan.world_size):
        stage = plan.mesh.coords(rank)["pp"]
        path = folder / f"ckpt_strategy_rank_{rank}.ckpt"
        write_strategy_file(path, entries[stage], stage, {n: splits[n] for n in entries[stage]})
        paths.append(path)
    return paths
