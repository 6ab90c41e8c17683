"""IR -> a Megatron-LM launch script in the style of Megatron's examples/ (torchrun + argument
arrays), which megatron.read reads back to the same IR. What Megatron cannot say (ZeRO-2, hybrid
sharding with FSDP2, zero-bubble schedules, arbitrary layer splits) comes back as warnings."""
from __future__ import annotations

import shlex

from ms_llm.convert.common import ConversionError, Written, cp_algorithm, num
from ms_llm.convert.megatron.model import write_model
from ms_llm.convert.megatron.read import CP_COMM_TYPES
from ms_llm.job import JobConfig
from ms_llm.strategy.devices import get_device


COMM_TYPES = {algorithm: kind for kind, algorithm in CP_COMM_TYPES.items()}


def _divisible_by(vocab: int, tp: int) -> int:
    """Largest power of two <= 128 whose product with tp divides the vocabulary: Megatron then
    pads nothing, so the padded size it computes is the ms_llm vocabulary exactly."""
    d = 128
    while d > 1 and vocab % (d * tp):
        d //= 2
    if vocab % (d * tp):
        raise ConversionError(f"model.vocab_size: {vocab} is not divisible by tp = {tp}")
    return d


def write(job: JobConfig, world_size: int) -> Written:
    m, s, t = job.model, job.strategy, job.train
    warnings: list[str] = []
    expressed = {"model", "strategy.dp", "strategy.tp", "strategy.pp", "strategy.cp", "strategy.ep", "strategy.etp",
                 "strategy.sequence_parallel", "strategy.pipeline.micro_batches", "strategy.recompute.policy",
                 "train.global_batch_size", "train.micro_batch_size", "train.seq_len", "train.steps", "train.seed",
                 "train.log_every", "train.optimizer", "train.schedule", "train.checkpoint.interval",
                 "train.checkpoint.async_save", "train.checkpoint.load", "strategy.offload.optimizer",
                 "strategy.precision", "strategy.zero.stage", "strategy.pipeline.virtual_stages",
                 "strategy.pipeline.schedule", "strategy.recompute.num_layers", "strategy.pipeline.layer_split",
                 "strategy.zero.shard_size", "train.data.paths", "train.data.weights", "train.data.split",
                 "train.data.tokenizer", "strategy.context_parallel"}
    model = write_model(m, t.seq_len, _divisible_by(m.vocab_size, s.tp), warnings)

    o, sch, ck, p = t.optimizer, t.schedule, t.checkpoint, s.precision
    training = [f"--micro-batch-size {t.micro_batch_size}", f"--global-batch-size {t.global_batch_size}",
                f"--train-iters {t.steps}", f"--lr {num(o.lr)}", f"--min-lr {num(o.lr * sch.min_lr_ratio)}",
                f"--lr-decay-style {sch.decay}", f"--lr-decay-iters {t.steps}", f"--lr-warmup-iters {sch.warmup_steps}",
                f"--weight-decay {num(o.weight_decay)}", f"--clip-grad {num(o.grad_clip)}", f"--seed {t.seed}"]
    if sch.warmup_steps and not sch.warmup_from_zero:
        warnings.append("train.schedule.warmup_from_zero = false: Megatron's warmup starts at 0 (update k runs at "
                        "lr*(k-1)/warmup, not lr*k/warmup); its warmup runs one update behind this job's")
    if o.weight_decay_1d:
        warnings.append("train.optimizer.weight_decay_1d = true: Megatron never decays biases and 1-D parameters "
                        "(norm weights), and has no flag to; they will not decay")
    if o.name == "adamw":
        training += [f"--adam-beta1 {num(o.beta1)}", f"--adam-beta2 {num(o.beta2)}", f"--adam-eps {num(o.eps)}"]
    else:
        training += ["--optimizer sgd", "--sgd-momentum 0.0"]
    training += _write_precision(p, warnings)

    parallel = [f"--tensor-model-parallel-size {s.tp}", f"--pipeline-model-parallel-size {s.pp}",
                f"--context-parallel-size {s.cp}"]
    algorithm = cp_algorithm(job, "Megatron's --cp-comm-type", warnings)
    if algorithm != "auto":
        parallel.append(f"--cp-comm-type {COMM_TYPES[algorithm]}")
    if s.ep > 1:
        parallel.append(f"--expert-model-parallel-size {s.ep}")
    if s.expert_tp != s.tp:       # Megatron's default is tp
        parallel.append(f"--expert-tensor-parallel-size {s.expert_tp}")
    if s.sequence_parallel:
        parallel.append("--sequence-parallel")
    parallel += _write_pipeline(m, s, warnings) + _write_zero(s, warnings) + _write_recompute(s, warnings)
    if s.offload.optimizer:
        parallel.append("--optimizer-cpu-offload")

    logging = [f"--log-interval {t.log_every}"]
    if ck.interval == "auto":
        warnings.append("train.checkpoint.interval = 'auto': Megatron needs a step count; no --save-interval written")
    elif ck.interval:
        logging += ['--save "$CHECKPOINT_PATH"', f"--save-interval {ck.interval}"]
    if ck.async_save:
        logging.append("--async-save")
    if ck.load:
        logging.append(f"--load {shlex.quote(ck.load)}")

    device = get_device(job.device)
    per_node = device.devices_per_node if world_size % device.devices_per_node == 0 else world_size
    groups = {"MODEL_ARGS": model, "TRAINING_ARGS": training, "MODEL_PARALLEL_ARGS": parallel,
              "EVAL_AND_LOGGING_ARGS": logging}
    lines = ["#!/bin/bash", f"# {job.name}: {m.name} on {world_size} devices; written by ms-llm convert-strategy.",
             "# Run from the Megatron-LM repository root. DATA_ARGS holds the datasets the job names; add",
             "# --tokenizer-type (and --data-path when it names none).", "",
             "export CUDA_DEVICE_MAX_CONNECTIONS=1", "",
             f"GPUS_PER_NODE={per_node}", f"NUM_NODES={world_size // per_node}",
             "MASTER_ADDR=${MASTER_ADDR:-localhost}", "MASTER_PORT=${MASTER_PORT:-6000}",
             "NODE_RANK=${NODE_RANK:-0}", f"CHECKPOINT_PATH=${{1:-checkpoints/{job.name}}}", "",
             "DISTRIBUTED_ARGS=(", "    --nproc_per_node $GPUS_PER_NODE", "    --nnodes $NUM_NODES",
             "    --node_rank $NODE_RANK", "    --master_addr $MASTER_ADDR", "    --master_port $MASTER_PORT", ")", ""]
    for name, args in groups.items():
        lines += [f"{name}=("] + [f"    {a}" for a in args] + [")", ""]
    lines += ["DATA_ARGS=("] + [f"    {a}" for a in _write_data(t.data)] + [")", ""]
    lines.append("torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\")
    lines += [f"    ${{{name}[@]}} \\" for name in groups] + ["    ${DATA_ARGS[@]}"]
    return Written("\n".join(lines) + "\n", expressed, warnings)


def _write_data(data) -> list[str]:
    """--data-path as weight prefix pairs (prefixes alone when unweighted), --split, --tokenizer-model."""
    out: list[str] = []
    spaced = [p for p in data.paths + (data.tokenizer,) if len(p.split()) > 1]
    if spaced:
        raise ConversionError(f"train.data: {spaced[0]!r} holds whitespace, which the script's unquoted argument "
                              "arrays (as in Megatron's examples) split; rename it")
    if data.paths:
        pairs = [f"{num(w)} {shlex.quote(p)}" for w, p in zip(data.weights, data.paths)] if data.weights else \
            [shlex.quote(p) for p in data.paths]
        out.append(f"--data-path {' '.join(pairs)}")
    out.append(f"--split {data.split}")
    if data.tokenizer:
        out.append(f"--tokenizer-model {shlex.quote(data.tokenizer)}")
    return out


def _write_precision(p, warnings: list[str]) -> list[str]:
    if p.param_dtype != p.compute_dtype:
        warnings.append(f"strategy.precision: params in {p.param_dtype}, compute in {p.compute_dtype}; Megatron "
                        f"holds and computes in one dtype ({p.compute_dtype} written)")
    dtype = p.compute_dtype
    if dtype == "float32":
        return []
    out = ["--bf16" if dtype == "bfloat16" else "--fp16"]
    if p.master_dtype != "float32":
        warnings.append(f"strategy.precision.master_dtype = {p.master_dtype}: Megatron always keeps float32 main "
                        "weights")
    if p.grad_reduce_dtype == "bfloat16":
        out.append("--grad-reduce-in-bf16")
    elif p.grad_reduce_dtype == "float16":
        warnings.append("strategy.precision.grad_reduce_dtype = float16: Megatron reduces in float32 or bfloat16; "
                        "float32 written")
    if dtype == "float16":
        if p.loss_scale == "static":
            out.append(f"--loss-scale {num(p.initial_loss_scale)}")
        else:
            out.append(f"--initial-loss-scale {num(p.initial_loss_scale)}")
    return out


def _write_pipeline(m, s, warnings: list[str]) -> list[str]:
    pipe = s.pipeline
    out: list[str] = []
    if s.pp > 1 and pipe.schedule in ("gpipe", "zero_bubble", "zbv"):
        warnings.append(f"strategy.pipeline.schedule = {pipe.schedule}: Megatron runs 1F1B or interleaved 1F1B; "
                        f"{'interleaved' if pipe.virtual_stages > 1 else '1F1B'} written")
    if pipe.virtual_stages > 1:
        out.append(f"--num-layers-per-virtual-pipeline-stage {m.num_layers // (s.pp * pipe.virtual_stages)}")
    split = pipe.layer_split
    if split is not None and s.pp > 1:
        middle = set(split[1:-1])
        if pipe.virtual_stages == 1 and len(middle) <= 1:
            out += [f"--decoder-first-pipeline-num-layers {split[0]}",
                    f"--decoder-last-pipeline-num-layers {split[-1]}"]
        else:
            warnings.append(f"strategy.pipeline.layer_split = {list(split)}: Megatron can only shorten the first "
                            "and last stage; the even split is written")
    return out


def _write_zero(s, warnings: list[str]) -> list[str]:
    stage = s.zero.stage
    if stage == 0:
        return []
    hybrid = s.zero.shard_size not in (-1, s.dp)
    if stage == 3 and s.pp == 1 and s.precision.compute_dtype != "float16" and not hybrid:
        return ["--use-torch-fsdp2"]
    if stage >= 2:
        why = "Megatron's FSDP2 path excludes pipeline parallel, fp16 and hybrid sharding" if stage == 3 else \
              "Megatron has no ZeRO-2"
        warnings.append(f"strategy.zero.stage = {stage}: {why}; the distributed optimizer (ZeRO-1) is written")
    out = ["--use-distributed-optimizer"]
    if hybrid:
        out.append(f"--num-distributed-optimizer-instances {s.dp // s.zero.shard_size}")
    return out


def _write_recompute(s, warnings: list[str]) -> list[str]:
    rc = s.recompute
    if rc.policy == "none":
        return []
    if rc.policy == "selective":
        if rc.num_layers != -1:
            warnings.append(f"strategy.recompute.num_layers = {rc.num_layers}: Megatron's selective recompute "
                            "covers every layer")
        return ["--recompute-granularity selective"]
    if rc.num_layers == -1:
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {rc.num_layers}"]
