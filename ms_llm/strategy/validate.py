"""Every rule a strategy must satisfy on every backend, checked once before any process starts.

`validate` collects all problems and raises one StrategyError listing each with the field
to change and how, the way torchtitan's ParallelDims prints every factor. What one backend
cannot run (yet) is that backend's support.py (ms_llm.backends dispatches), not a rule here.
"""
from __future__ import annotations

import dataclasses

from ms_llm.config.model import DTYPE_BYTES, ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.errors import StrategyError
from ms_llm.strategy.ir import MULTI_CHUNK_SCHEDULES, ParallelStrategy


def _degrees(s: ParallelStrategy) -> list[str]:
    return [f"{n}={getattr(s, n)}" for n in ("dp", "tp", "pp", "cp") if getattr(s, n) != 1]


def resolve(strategy: ParallelStrategy, train: TrainConfig, world_size: int | None) -> ParallelStrategy:
    """Fill every derived value (dp = -1, zero.shard_size = -1, pipeline.micro_batches = -1)."""
    s = strategy.resolve(world_size)
    mb = s.pipeline.micro_batches
    if mb == -1:
        per_step = train.micro_batch_size * s.dp
        mb = max(1, train.global_batch_size // per_step)
    return dataclasses.replace(s, pipeline=dataclasses.replace(s.pipeline, micro_batches=mb))


def _divides(problems: list[str], field: str, value: int, what: str, n: int, fix: str) -> None:
    if n > 1 and value % n:
        problems.append(f"{field}: {what} = {value} is not divisible by {n}; {fix}")


def _context_parallel(problems: list[str], model: ModelConfig, s: ParallelStrategy, train: TrainConfig) -> None:
    """ring / allgather cut the sequence into 2*cp load-balanced chunks; ulysses cuts it into cp
    and shards heads over tp*cp (K/V heads that cp does not divide are repeated to the query
    heads before the all-to-all, as DeepSpeed-Ulysses does for GQA). 'auto' needs one of them."""
    cp, algorithm = s.cp, s.context_parallel.algorithm
    field = "strategy.context_parallel.algorithm"
    if algorithm in ("ring", "allgather"):
        _divides(problems, "strategy.cp", train.seq_len, "train.seq_len", 2 * cp,
                 f"{algorithm} context parallel splits each sequence into 2*cp load-balanced chunks; "
                 "change seq_len or cp")
    elif algorithm == "ulysses":
        _divides(problems, "strategy.cp", train.seq_len, "train.seq_len", cp, "change seq_len or cp")
        _divides(problems, field, model.num_heads, "model.num_heads", s.tp * cp,
                 f"ulysses shards heads over tp*cp = {s.tp}*{cp}; use ring, or tp*cp dividing the head count")
    elif train.seq_len % (2 * cp) and (train.seq_len % cp or model.num_heads % (s.tp * cp)):
        problems.append(f"strategy.cp: no context-parallel algorithm fits: train.seq_len = {train.seq_len} is not "
                        f"divisible by 2*cp = {2 * cp} (ring, allgather), and ulysses needs seq_len and "
                        f"model.num_heads = {model.num_heads} divisible by cp (heads by tp*cp); change seq_len or cp")


def _experts(problems: list[str], model: ModelConfig, s: ParallelStrategy) -> None:
    """Expert parallel folding (Megatron-core's): a stage's dp*cp*tp ranks read as (edp, ep, etp), so
    ep*etp must divide them; ep splits the experts, etp each expert's width."""
    ep, etp, ranks = s.ep, s.etp, s.dp * s.cp * s.tp
    if model.moe is None:
        if ep > 1:
            problems.append(f"strategy.ep: {ep} but the model is dense (no model.moe); use ep = 1")
        if etp != s.tp:
            problems.append(f"strategy.etp: {etp} but the model is dense (no model.moe); leave etp unset (-1)")
        return
    _divides(problems, "strategy.ep", model.moe.num_experts, "model.moe.num_experts", ep,
             "choose ep dividing the expert count")
    _divides(problems, "strategy.etp", model.expert_ffn_size, "the expert width (model.moe.expert_ffn_hidden_size)",
             etp, "choose etp dividing the expert MLP width (etp = -1 is tp, 1 keeps experts whole)")
    if ranks % (ep * etp):
        problems.append(f"strategy.ep: ep*etp = {ep}*{etp} = {ep * etp} must divide dp*cp*tp = {s.dp}*{s.cp}*{s.tp} "
                        f"= {ranks} (the experts fold over a stage's ranks as edp x ep x etp); change ep, or "
                        f"etp (-1 = tp, 1 = whole experts)")


def validate(model: ModelConfig, strategy: ParallelStrategy, train: TrainConfig,
             world_size: int | None = None) -> ParallelStrategy:
    """Return the resolved strategy, or raise StrategyError naming every broken rule."""
    s = resolve(strategy, train, world_size)
    problems: list[str] = []
    tp, pp, cp, dp = s.tp, s.pp, s.cp, s.dp
    pipe, zero, prec = s.pipeline, s.zero, s.precision
    vpp = pipe.virtual_stages

    # Tensor parallel: every split dimension must divide evenly.
    if model.mla is not None:
        _divides(problems, "strategy.tp", model.num_heads, "model.num_heads", tp,
                 "multi-latent attention (model.mla) splits q_b_proj / kv_b_proj / o_proj by whole heads over tp; "
                 "choose tp dividing the head count")
    else:
        _divides(problems, "strategy.tp", model.num_heads, "model.num_heads", tp, "choose tp dividing the head count")
        _divides(problems, "strategy.tp", model.num_kv_heads, "model.num_kv_heads", tp,
                 "choose tp dividing the kv-head count (GQA groups are not split)")
    if any(not model.is_moe_layer(i) for i in range(model.num_layers + model.mtp_layers)):
        _divides(problems, "strategy.tp", model.ffn_hidden_size, "model.ffn_hidden_size", tp,
                 "choose tp dividing the MLP width")
    if model.mtp_layers:
        _divides(problems, "strategy.tp", model.hidden_size, "model.hidden_size", tp,
                 "the MTP modules' eh_proj is column-parallel over its hidden_size outputs; choose tp dividing it")
    _divides(problems, "strategy.tp", model.vocab_size, "model.vocab_size", tp,
             f"pad model.vocab_size to a multiple of {tp} (vocab-parallel embedding and head)")
    if s.sequence_parallel and tp == 1:
        problems.append("strategy.sequence_parallel: needs tp > 1 (it shards activations over the tp group); "
                        "set tp >= 2 or sequence_parallel: false")
    seq_split = cp * (tp if s.sequence_parallel else 1)
    if cp > 1:
        _context_parallel(problems, model, s, train)
    if seq_split > 1 and s.sequence_parallel:
        _divides(problems, "strategy.sequence_parallel", train.seq_len, "train.seq_len", seq_split,
                 "sequence parallel shards the sequence over cp*tp; change seq_len, tp or cp")
    if train.seq_len > model.max_seq_len:
        problems.append(f"train.seq_len: {train.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                        "raise max_seq_len or shorten the sequence")

    # Pipeline: layer split, schedule, micro-batches.
    chunks = pp * vpp
    if pp > model.num_layers:
        problems.append(f"strategy.pp: {pp} stages for {model.num_layers} layers; use pp <= num_layers")
    if pipe.layer_split is None:
        _divides(problems, "strategy.pp", model.num_layers, "model.num_layers", chunks,
                 f"with pp*virtual_stages = {pp}*{vpp} use a dividing degree or give "
                 "strategy.pipeline.layer_split explicitly")
    else:
        split = pipe.layer_split
        if len(split) != chunks:
            problems.append(f"strategy.pipeline.layer_split: {len(split)} entries, need pp*virtual_stages = "
                            f"{chunks} (one per model chunk)")
        elif sum(split) != model.num_layers:
            problems.append(f"strategy.pipeline.layer_split: sums to {sum(split)}, model.num_layers is "
                            f"{model.num_layers}; make the counts add up")
        if any(n < 1 for n in split):
            problems.append("strategy.pipeline.layer_split: every chunk needs at least 1 layer")
    multi = pipe.schedule in MULTI_CHUNK_SCHEDULES
    if pp > 1 and multi and vpp < 2:
        problems.append(f"strategy.pipeline.virtual_stages: schedule {pipe.schedule} needs >= 2 chunks per "
                        "rank; set virtual_stages: 2 or pick schedule 1f1b")
    if vpp > 1 and not multi:
        problems.append(f"strategy.pipeline.schedule: {pipe.schedule} runs one chunk per rank but "
                        f"virtual_stages = {vpp}; use interleaved_1f1b (or zbv for 2) or virtual_stages: 1")
    if vpp > 1 and pp == 1:
        problems.append("strategy.pipeline.virtual_stages: virtual stages need pp > 1")
    if pipe.schedule == "zbv" and vpp not in (1, 2) and pp > 1:
        problems.append(f"strategy.pipeline.virtual_stages: zbv is a V schedule of exactly 2 chunks per rank, "
                        f"got {vpp}")
    mb = pipe.micro_batches
    if pp > 1:
        if pipe.schedule == "interleaved_1f1b" and mb % pp:
            problems.append(f"strategy.pipeline.micro_batches: interleaved_1f1b needs micro_batches % pp == 0, "
                            f"got {mb} % {pp}; use a multiple of {pp}")
        if pipe.schedule in ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv") and mb < pp:
            problems.append(f"strategy.pipeline.micro_batches: {pipe.schedule} needs at least pp = {pp} "
                            f"micro-batches to fill the pipeline, got {mb}; raise the global batch or use gpipe")
    if model.tie_embeddings and pp > 1:
        problems.append("model.tie_embeddings: tied embeddings with pp > 1 would need an extra "
                        "embedding group; untie them or use pp = 1")

    # Batch arithmetic: global = micro_batch * dp * micro_batches.
    expected = train.micro_batch_size * dp * mb
    if train.global_batch_size != expected:
        problems.append(
            f"train.global_batch_size: {train.global_batch_size} != micro_batch_size * dp * micro_batches = "
            f"{train.micro_batch_size}*{dp}*{mb} = {expected}; make the global batch a multiple of "
            f"{train.micro_batch_size * dp} or set strategy.pipeline.micro_batches: -1")

    # ZeRO.
    if zero.stage > 0 and dp > 1 and dp % zero.shard_size:
        problems.append(f"strategy.zero.shard_size: {zero.shard_size} does not divide dp = {dp}; "
                        "pick a divisor of dp (HSDP replicates dp/shard_size groups)")
    if zero.shard_size > dp:
        problems.append(f"strategy.zero.shard_size: {zero.shard_size} exceeds dp = {dp}")

    _experts(problems, model, s)

    # Recompute.
    if s.recompute.num_layers != -1 and s.recompute.policy == "none":
        problems.append("strategy.recompute.num_layers: set but policy is 'none'; choose selective or full")
    max_per_stage = model.num_layers // max(1, chunks) * vpp
    if s.recompute.num_layers > max(1, max_per_stage) and pipe.layer_split is None:
        problems.append(f"strategy.recompute.num_layers: {s.recompute.num_layers} exceeds the {max_per_stage} "
                        "layers of a stage; use -1 for all")

    # Precision.
    bytes_of = DTYPE_BYTES
    if "float16" in (prec.compute_dtype, prec.param_dtype) and prec.loss_scale == "none":
        problems.append("strategy.precision.loss_scale: fp16 needs loss scaling to keep small gradients; "
                        "set loss_scale: dynamic (or use bfloat16)")
    if bytes_of[prec.master_dtype] < bytes_of[prec.param_dtype]:
        problems.append(f"strategy.precision.master_dtype: {prec.master_dtype} is narrower than "
                        f"param_dtype {prec.param_dtype}; the master copy must be at least as precise")
    if prec.param_dtype == "float32" and prec.compute_dtype == "float32" and prec.loss_scale != "none":
        problems.append("strategy.precision.loss_scale: fp32 training needs no loss scaling; set 'none'")

    # Offload.
    if s.offload.params and zero.stage < 3:
        problems.append(f"strategy.offload.params: needs zero.stage 3 (only sharded parameters are offloaded), "
                        f"got stage {zero.stage}")
    if s.offload.optimizer and zero.stage < 1:
        problems.append("strategy.offload.optimizer: needs zero.stage >= 1 (the partitioned optimizer runs on "
                        "the host); set zero.stage: 1 or higher")

    if problems:
        raise StrategyError(problems)
    return s
