"""Megatron-LM command-line arguments -> IR (megatron_script.py writes them back).

Reads a launch script (`torchrun ... pretrain_gpt.py --flag value ...`, see shell.py) or a file
holding just the arguments. The world size is torchrun's nproc_per_node * nnodes or --world-size.
Implicit values are resolved as Megatron's arguments.py does: dp = world / (tp * pp * cp), the
experts folded over the same ranks as edp x ep x etp with etp = tp unless
--expert-tensor-parallel-size says otherwise (MoE parallel folding),
global batch = micro batch * dp when unset, sequence parallel dropped when tp = 1, vocabulary
padded to a multiple of make-vocab-size-divisible-by * tp, embeddings tied unless
--untie-embeddings-and-output-weights, dropout 0.1, weight decay 0.01, Adam beta2 0.999.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, make_job
from ms_llm.convert.megatron.model import read_model
from ms_llm.convert.shell import launch_command

# --cp-comm-type (megatron-core TransformerConfig.cp_comm_type) <-> strategy.context_parallel.algorithm;
# a2a+p2p (hierarchical: a2a inside --hierarchical-context-parallel-sizes groups, p2p across) has no IR name.
CP_COMM_TYPES = {"p2p": "ring", "a2a": "ulysses", "all_gather": "allgather"}
DECAY_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant"}


def parse_args(words: list[str], source: str) -> dict[str, object]:
    """argparse-like: `--flag` -> True, `--flag v` -> 'v', `--flag a b c` -> ['a', 'b', 'c']."""
    out: dict[str, object] = {}
    flag = None
    for word in words:
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            out[flag] = value if value else True
        elif flag is None:
            raise ConversionError(f"{source}: {word!r} comes before any --flag; Megatron-LM takes only --flags")
        else:
            current = out[flag]
            if current is True:
                out[flag] = word
            else:
                out[flag] = (current if isinstance(current, list) else [current]) + [word]
    return out


def world_from_launcher(launcher: list[str], source: str, warnings: list[str]) -> int | None:
    """nproc_per_node * nnodes of a torchrun launcher; None for any other launcher."""
    if not any(Path(w).name in ("torchrun", "torch.distributed.run") for w in launcher):
        return None
    first = next((i for i, w in enumerate(launcher) if w.startswith("--")), len(launcher))
    opts = parse_args(launcher[first:], source)
    f = Fields({k.replace("_", "-"): v for k, v in opts.items()}, source, text=True)
    nproc = f.get("--nproc-per-node", str, "1")
    nnodes = f.get("--nnodes", str, "1")
    if ":" in nnodes:
        nnodes = nnodes.split(":")[1]
        warnings.append(f"torchrun --nnodes is elastic; planning for its maximum, {nnodes} nodes")
    if not (nproc.isdigit() and nnodes.isdigit()):
        warnings.append(f"torchrun --nproc_per_node {nproc!r} --nnodes {nnodes!r}: not numbers; "
                        "world size unknown (pass --world-size)")
        return None
    return int(nproc) * int(nnodes)


def read(text: str, source: str, options: ReadOptions) -> Converted:
    warnings: list[str] = []
    code = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    words = shlex.split(text.replace("\\\n", " "), comments=True) if code and code[0].startswith("--") else None
    launched = None
    if words is None:
        launch = launch_command(text, source)
        words, warnings = launch.args, warnings + launch.notes
        launched = world_from_launcher(launch.launcher, source, warnings)
    f = Fields(parse_args(words, source), source, text=True)
    world = options.world_size or launched
    if options.world_size and launched and options.world_size != launched:
        warnings.append(f"the script launches {launched} processes; planning for --world-size {options.world_size}")

    tp = f.get("--tensor-model-parallel-size", int, 1, ir="strategy.tp")
    pp = f.get("--pipeline-model-parallel-size", int, 1, ir="strategy.pp")
    cp = f.get("--context-parallel-size", int, 1, ir="strategy.cp")
    ep = f.get("--expert-model-parallel-size", int, 1, ir="strategy.ep")
    etp = f.get("--expert-tensor-parallel-size", int, -1, ir="strategy.etp")     # Megatron's default: tp
    dp = world // (tp * pp * cp) if world and world % (tp * pp * cp) == 0 else None
    if world and dp is None:
        raise ConversionError(f"{source}: world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} "
                              f"(Megatron computes dp = world / (tp*pp*cp)); pass --world-size N with a multiple "
                              f"of {tp * pp * cp}")
    model, tie_note = read_model(f, tp, pp, warnings)
    if model["moe"] is None and etp not in (-1, tp):
        warnings.append(f"--expert-tensor-parallel-size {etp}: the model has no experts; dropped")
        etp = -1
    strategy = {"dp": dp or -1, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp,
                "context_parallel": {"algorithm": _cp_algorithm(f, cp, warnings)}}
    sp = f.get("--sequence-parallel", bool, False, ir="strategy.sequence_parallel")
    if sp and tp == 1:
        warnings.append("--sequence-parallel with tp = 1: Megatron turns it off, and so does this conversion")
        sp = False
    strategy["sequence_parallel"] = sp
    strategy["pipeline"] = _pipeline(f, model["num_layers"], pp)
    strategy["zero"] = _zero(f, dp)
    strategy["recompute"] = _recompute(f, warnings)
    strategy["precision"] = _precision(f, warnings)
    strategy["offload"] = {"optimizer": f.get("--optimizer-cpu-offload", bool, False, ir="strategy.offload")}
    model["dtype"] = strategy["precision"]["param_dtype"]
    train = _train(f, dp, warnings)
    _qk_layernorm_decay(f, model, warnings)
    if tie_note:
        warnings.append(tie_note)
    job = make_job(f, name=Path(source).stem, model=model, strategy=strategy, train=train,
                   device=options.device or "h100")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _qk_layernorm_decay(f: Fields, model: dict, warnings: list[str]) -> None:
    """--apply-wd-to-qk-layernorm (Qwen3-Next): Megatron then decays the q/k layernorm weights, the one
    1-D exception to its no-decay rule (names with q_layernorm. / k_layernorm.: --qk-layernorm's, and
    MLA's q latent norm; not MLA's kv_layernorm); ms_llm exempts every 1-D parameter or none."""
    if not f.get("--apply-wd-to-qk-layernorm", bool, False, ir="train.optimizer.weight_decay_1d"):
        return
    if model.get("qk_norm") or (model.get("mla") or {}).get("q_lora_rank"):
        warnings.append("--apply-wd-to-qk-layernorm: Megatron decays the q/k layernorm weights, ms_llm exempts them "
                        "like every 1-D parameter (train.optimizer.weight_decay_1d: false)")


def _cp_algorithm(f: Fields, cp: int, warnings: list[str]) -> str:
    """--cp-comm-type (one value, or one per layer); Megatron's default is p2p, i.e. ring."""
    given = f.raw("--cp-comm-type", ir="strategy.context_parallel.algorithm")
    if given is None:
        return "ring" if cp > 1 else "auto"
    kinds = sorted(set([given] if isinstance(given, str) else given))
    if len(kinds) > 1:
        warnings.append(f"--cp-comm-type {' '.join(given)}: one type per layer is not modelled; "
                        f"{given[0]} is read for every layer")
    kind = given if isinstance(given, str) else given[0]
    if kind == "a2a+p2p":
        warnings.append("--cp-comm-type a2a+p2p (hierarchical context parallel) has no ms_llm equivalent; read as "
                        "ring (p2p) over the whole cp group")
        return "ring"
    if kind not in CP_COMM_TYPES:
        raise f.error("--cp-comm-type", f"got {kind!r}; expected one of p2p, a2a, all_gather, a2a+p2p")
    return CP_COMM_TYPES[kind]


def _pipeline(f: Fields, layers: int, pp: int) -> dict:
    per_chunk = f.get("--num-layers-per-virtual-pipeline-stage", int, 0, ir="strategy.pipeline.virtual_stages")
    vpp = f.get("--num-virtual-stages-per-pipeline-rank", int, 0, ir="strategy.pipeline.virtual_stages")
    if per_chunk and vpp:
        raise f.error("--num-virtual-stages-per-pipeline-rank", "given together with "
                      "--num-layers-per-virtual-pipeline-stage; Megatron accepts only one of them")
    if per_chunk:
        if layers % (pp * per_chunk):
            raise f.error("--num-layers-per-virtual-pipeline-stage", f"{per_chunk} does not divide the "
                          f"{layers // pp} layers of each of the {pp} stages")
        vpp = layers // pp // per_chunk
    vpp = vpp or 1
    pipe: dict = {"schedule": "interleaved_1f1b" if vpp > 1 else "1f1b", "virtual_stages": vpp}
    first = f.get("--decoder-first-pipeline-num-layers", int, 0, ir="strategy.pipeline.layer_split")
    last = f.get("--decoder-last-pipeline-num-layers", int, 0, ir="strategy.pipeline.layer_split")
    if (first or last) and pp > 1:
        if vpp > 1:
            raise f.error("--decoder-first-pipeline-num-layers", "uneven first/last stages with virtual "
                          "pipeline stages are not supported by this conversion; give an even split")
        middle = layers - first - last
        inner = pp - (1 if first else 0) - (1 if last else 0)
        if inner and middle % inner:
            raise f.error("--decoder-first-pipeline-num-layers", f"the {middle} remaining layers do not divide "
                          f"evenly over the {inner} middle stages")
        each = middle // inner if inner else 0
        split = [each] * pp
        if first:
            split[0] = first
        if last:
            split[-1] = last
        pipe["layer_split"] = split
    return pipe


def _zero(f: Fields, dp: int | None) -> dict:
    distopt = f.get("--use-distributed-optimizer", bool, False, ir="strategy.zero.stage")
    fsdp = f.get("--use-torch-fsdp2", bool, False, ir="strategy.zero.stage")
    if distopt and fsdp:
        raise f.error("--use-torch-fsdp2", "cannot be combined with --use-distributed-optimizer (Megatron "
                                           "rejects it); keep one")
    zero = {"stage": 3 if fsdp else 1 if distopt else 0}
    instances = f.get("--num-distributed-optimizer-instances", int, 1, ir="strategy.zero.shard_size")
    if instances > 1:
        if dp is None:
            raise f.error("--num-distributed-optimizer-instances", "needs the world size to know dp; pass "
                                                                   "--world-size N")
        if dp % instances:
            raise f.error("--num-distributed-optimizer-instances", f"{instances} does not divide dp = {dp}")
        zero["shard_size"] = dp // instances
    return zero


def _recompute(f: Fields, warnings: list[str]) -> dict:
    granularity = f.get("--recompute-granularity", ("full", "selective"), None, ir="strategy.recompute.policy")
    if f.get("--recompute-activations", bool, False, ir="strategy.recompute.policy"):
        granularity = "selective"
    if granularity is None:
        return {}
    if granularity == "selective":
        modules = f.data.get("--recompute-modules", "core_attn")
        f.used.add("--recompute-modules")
        modules = " ".join(modules) if isinstance(modules, list) else modules
        warnings.append(f"selective recompute ({modules}): ms_llm's selective policy recomputes the attention "
                        "core and the MLP activation")
        return {"policy": "selective"}
    method = f.get("--recompute-method", ("uniform", "block"), None, ir="strategy.recompute.num_layers")
    n = f.get("--recompute-num-layers", int, 1, ir="strategy.recompute.num_layers")
    if method is None:
        raise f.error("--recompute-granularity", "full needs --recompute-method uniform|block (Megatron refuses "
                                                 "it without)")
    if method == "block":
        return {"policy": "full", "num_layers": n}
    if n != 1:
        warnings.append(f"--recompute-method uniform --recompute-num-layers {n}: Megatron keeps one input per "
                        f"{n} layers; ms_llm keeps one per layer (a little more memory)")
    return {"policy": "full"}


def _precision(f: Fields, warnings: list[str]) -> dict:
    bf16 = f.get("--bf16", bool, False, ir="strategy.precision")
    fp16 = f.get("--fp16", bool, False, ir="strategy.precision")
    if bf16 and fp16:
        raise f.error("--fp16", "given together with --bf16; pick one")
    if f.has("--fp8-format"):
        warnings.append(f"--fp8-format {f.get('--fp8-format', str)}: fp8 matmuls are not modelled; "
                        f"{'bf16' if bf16 else 'fp16' if fp16 else 'fp32'} is kept")
    if not (bf16 or fp16):
        return {"param_dtype": "float32", "compute_dtype": "float32", "master_dtype": "float32",
                "grad_reduce_dtype": "float32"}
    dtype = "bfloat16" if bf16 else "float16"
    reduce = "bfloat16" if f.get("--grad-reduce-in-bf16", bool, False, ir="strategy.precision.grad_reduce_dtype") \
        else "float32"
    prec = {"param_dtype": dtype, "compute_dtype": dtype, "master_dtype": "float32", "grad_reduce_dtype": reduce}
    if fp16:
        if f.has("--loss-scale"):
            prec.update(loss_scale="static", initial_loss_scale=f.get("--loss-scale", float))
        else:
            prec.update(loss_scale="dynamic",
                        initial_loss_scale=f.get("--initial-loss-scale", float, 2.0 ** 32,
                                                 ir="strategy.precision.initial_loss_scale"))
    return prec


def _data(f: Fields, warnings: list[str]) -> dict:
    """--data-path (prefixes, or weight prefix pairs), --split and --tokenizer-model -> train.data."""
    data: dict = {"split": f.get("--split", str, "969,30,1", ir="train.data.split").replace(" ", "")}
    if f.has("--tokenizer-model") and f.raw("--tokenizer-model") is not True:
        data["tokenizer"] = f.get("--tokenizer-model", str, ir="train.data.tokenizer")
    words = f.raw("--data-path", ir="train.data.paths")
    if words is True:
        warnings.append("--data-path has no value (an unset shell variable?); train.data.paths left empty")
        return data
    words = [words] if isinstance(words, str) else words or []
    numbers = [_is_number(w) for w in words]
    if not any(numbers):
        data["paths"] = words
    elif len(words) % 2 == 0 and numbers == [True, False] * (len(words) // 2):
        data.update(paths=words[1::2], weights=[float(w) for w in words[0::2]])
    else:
        raise f.error("--data-path", f"got {' '.join(words)!r}; expected prefixes, or weight prefix pairs")
    return data


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _train(f: Fields, dp: int | None, warnings: list[str]) -> dict:
    mbs = f.get("--micro-batch-size", int, None, ir="train.micro_batch_size")
    if mbs is None:
        mbs = 1
        warnings.append("--micro-batch-size not set; using 1")
    gbs = f.get("--global-batch-size", int, None, ir="train.global_batch_size")
    if gbs is None:
        if dp is None:
            raise f.error("--global-batch-size", "not set, and Megatron's default (micro batch * dp) needs the "
                                                 "world size; pass --world-size N")
        gbs = mbs * dp
    elif dp and gbs % (mbs * dp):
        raise f.error("--global-batch-size", f"{gbs} is not a multiple of micro batch * dp = {mbs}*{dp}; "
                                             "Megatron refuses it")
    if f.has("--rampup-batch-size"):
        ramp = f.get("--rampup-batch-size", list)
        warnings.append(f"--rampup-batch-size {' '.join(ramp)}: batch ramp-up is not modelled; the final "
                        f"global batch {gbs} is used throughout")
    steps = f.get("--train-iters", int, None, ir="train.steps")
    if steps is None and f.has("--train-samples"):
        steps = f.get("--train-samples", int) // gbs
        warnings.append(f"--train-samples read as {steps} steps of {gbs} sequences")
    lr = f.get("--lr", float, 3e-4, ir="train.optimizer.lr")
    optimizer = f.get("--optimizer", ("adam", "sgd"), "adam", ir="train.optimizer.name")
    # weight_decay_1d: Megatron's default no_weight_decay_cond exempts biases and 1-D parameters (norm
    # weights), with no flag to decay them (--apply-wd-to-qk-layernorm aside: _qk_layernorm_decay).
    opt: dict = {"name": "adamw" if optimizer == "adam" else "sgd", "lr": lr,
                 "weight_decay": f.get("--weight-decay", float, 0.01, ir="train.optimizer.weight_decay"),
                 "weight_decay_1d": False,
                 "beta1": f.get("--adam-beta1", float, 0.9, ir="train.optimizer.beta1"),
                 "beta2": f.get("--adam-beta2", float, 0.999, ir="train.optimizer.beta2"),
                 "eps": f.get("--adam-eps", float, 1e-8, ir="train.optimizer.eps"),
                 "grad_clip": f.get("--clip-grad", float, 1.0, ir="train.optimizer.grad_clip")}
    if optimizer == "sgd" and f.get("--sgd-momentum", float, 0.9):
        warnings.append("--optimizer sgd with momentum: ms_llm's SGD has no momentum")
    style = f.get("--lr-decay-style", str, "linear", ir="train.schedule.decay")
    if style not in DECAY_STYLES:
        warnings.append(f"--lr-decay-style {style}: not modelled; cosine decay is used")
    decay_iters = f.get("--lr-decay-iters", int, steps)
    if f.has("--lr-decay-samples"):
        decay_iters = f.get("--lr-decay-samples", int) // gbs
    if steps is not None and decay_iters != steps:
        warnings.append(f"the learning rate decays over {decay_iters} steps, the run has {steps}; ms_llm decays "
                        "over the whole run")
    warmup = f.get("--lr-warmup-iters", int, 0, ir="train.schedule.warmup_steps")
    if f.has("--lr-warmup-fraction"):
        warmup = round(f.get("--lr-warmup-fraction", float) * (decay_iters or 0))
    if f.has("--lr-warmup-samples"):
        warmup = f.get("--lr-warmup-samples", int) // gbs
    # warmup_from_zero: OptimizerParamScheduler starts at step(0) and steps after each update, so update k runs
    # at lr*(k-1)/warmup; its first update at rate 0. Without warmup the flag changes nothing: left false, so
    # a job without warmup round-trips unchanged.
    schedule = {"warmup_steps": warmup, "decay": DECAY_STYLES.get(style, "cosine"),
                "min_lr_ratio": f.get("--min-lr", float, 0.0, ir="train.schedule.min_lr_ratio") / lr if lr else 0.0,
                "warmup_from_zero": warmup > 0}
    saving, load = f.has("--save"), f.data.get("--load")
    f.used.update(("--save", "--load"))
    interval = f.get("--save-interval", int, 0, ir="train.checkpoint.interval")
    if interval and not saving:
        warnings.append(f"--save-interval {interval} without --save: Megatron saves nothing; checkpointing off")
    checkpoint: dict = {"interval": interval if saving else 0,
                        "async_save": f.get("--async-save", bool, False, ir="train.checkpoint.async_save")}
    if isinstance(load, str):
        checkpoint["load"] = load
    if f.has("--ckpt-format"):
        warnings.append(f"--ckpt-format {f.get('--ckpt-format', str)}: ms_llm writes its own sharded "
                        "safetensors format")
    train = {"global_batch_size": gbs, "micro_batch_size": mbs, "seq_len": f.get("--seq-length", int),
             "data": _data(f, warnings),
             "seed": f.get("--seed", int, 1234, ir="train.seed"),
             "log_every": f.get("--log-interval", int, 100, ir="train.log_every"),
             "optimizer": opt, "schedule": schedule, "checkpoint": checkpoint}
    if steps is not None:
        train["steps"] = steps
    return train

