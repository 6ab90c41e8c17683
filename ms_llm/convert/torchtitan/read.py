"""torchtitan jobs -> IR: v0.2.x TOML (torchtitan_toml.py writes it back) and 0.3 jobs, a
registered config plus command-line overrides (torchtitan_args.py reads them into the same sections;
torchtitan_job.py writes them).

Resolved as torchtitan does: data_parallel_shard_degree = -1 takes the ranks left after
replicate * cp * tp * pp (so the world size must be known: --world-size, the NGPU of
run_train.sh); FSDP (ZeRO-3, HSDP when replicate > 1) is on when dp_shard * cp > 1; the global
batch defaults to local_batch_size * dp; with pipeline parallel the local batch is cut into
micro-batches of pipeline_parallel_microbatch_size, and the layers are split by torchtitan's
generate_llm_fqn_per_model_part (embedding and output each weigh one layer) unless
module_fqns_per_model_part lists them. The model is a flavor name: DeepSeek-V3's and Qwen3-MoE's
come from their model args (torchtitan/flavors.py), LLaMA's map to configs/models, others need
--model or a configs/models/<flavor>.yaml.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, to_dict
from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, make_job
from ms_llm.convert.torchtitan import args as torchtitan_args, flavors
from ms_llm.job import CONFIG_ROOT, load_section

FLAVORS = {("llama3", "8B"): "llama3_8b", ("llama3", "70B"): "llama3_70b"}
# v0.2.x context_parallel_rotate_method (PyTorch's _RotateMethod): alltoall passes K/V shards around
# the ring, allgather gathers them. 0.3 has no such setting: its SDPA dispatcher runs PyTorch's
# default, allgather (and FlexAttention gathers K/V itself), so a 0.3 job reads as allgather.
ROTATE_METHODS = {"allgather": "allgather", "alltoall": "ring"}
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved_1f1b",
             "interleavedzerobubble": "zero_bubble", "zbvzerobubble": "zbv", "dualpipev": "zbv",
             "loopedbfs": "interleaved_1f1b"}
SINGLE_STAGE = ("1f1b", "gpipe")
DECAY = {"linear": "linear", "cosine": "cosine", "sqrt": "linear"}


def _tomllib():
    try:
        import tomllib
    except ModuleNotFoundError:
        raise ConversionError("reading torchtitan TOML needs Python 3.11 or newer (tomllib)") from None
    return tomllib


def read(text: str, source: str, options: ReadOptions) -> Converted:
    """A v0.2.x TOML, or a 0.3 job (module + config + overrides: torchtitan_job.py)."""
    if torchtitan_args.is_job(text):
        data, warnings, launched = torchtitan_args.sections(text, source)
        f = Fields(data, source, text=True)
        f.accept_usual({"training.disable_cuda_graphs": (True,)})     # how 0.3 runs pipeline / expert parallel
        options = dataclasses.replace(options, world_size=options.world_size or launched)
    else:
        tomllib = _tomllib()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConversionError(f"{source}: not valid TOML ({exc})") from None
        f, warnings, launched = Fields(data, source), [], None
    model = _model(f, options, warnings)
    par = "parallelism"
    rep = f.get(f"{par}.data_parallel_replicate_degree", int, 1, ir="strategy.dp")
    shard = f.get(f"{par}.data_parallel_shard_degree", int, -1, ir="strategy.dp")
    tp = f.get(f"{par}.tensor_parallel_degree", int, 1, ir="strategy.tp")
    pp = f.get(f"{par}.pipeline_parallel_degree", int, 1, ir="strategy.pp")
    cp = f.get(f"{par}.context_parallel_degree", int, 1, ir="strategy.cp")
    ep = f.get(f"{par}.expert_parallel_degree", int, 1, ir="strategy.ep")
    etp = f.get(f"{par}.expert_tensor_parallel_degree", int, 1, ir="strategy.etp")
    if ep > 1 and etp not in (1, tp):
        raise f.error(f"{par}.expert_tensor_parallel_degree", f"{etp} must be 1 or tensor_parallel_degree = {tp}")
    world = _world(f, options.world_size, rep, shard, cp, tp, pp)
    shard = world // (rep * cp * tp * pp) if shard == -1 else shard
    dp = rep * shard
    fsdp = shard * cp > 1
    rotate = f.get(f"{par}.context_parallel_rotate_method", tuple(ROTATE_METHODS), "allgather",
                   ir="strategy.context_parallel.algorithm")
    # Under expert parallel torchtitan 0.3 keeps experts whole, ep borrowing dp_shard x cp x tp ranks
    # (ms_llm's etp 1); v0.2.x's expert_tensor_parallel_degree (default 1) could also be tp, which
    # splits them like the dense MLP (ms_llm's etp -1, = tp). Without ep the experts follow tp.
    strategy = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": 1 if ep > 1 and etp == 1 and tp > 1 else -1,
                "sequence_parallel": tp > 1,
                "context_parallel": {"algorithm": ROTATE_METHODS[rotate] if cp > 1 else "auto"},
                "zero": {"stage": 3, "shard_size": shard} if fsdp else {},
                "precision": _precision(f, fsdp, tp, pp, warnings)}
    model_dict = {**to_dict(model, full=True), "dtype": strategy["precision"]["param_dtype"]}
    if f.get("training.enable_cpu_offload", bool, False, ir="strategy.offload"):
        strategy["offload"] = {"optimizer": True, "params": True}
    train = _batch(f, dp, pp)
    strategy["pipeline"] = _pipeline(f, model.num_layers, pp)
    strategy["recompute"] = _recompute(f, model.num_layers, pp, warnings)
    train.update(_optimizer(f, warnings))
    train["checkpoint"] = _checkpoint(f, warnings)
    if train["seq_len"] > model_dict["max_seq_len"]:
        warnings.append(f"model.max_seq_len raised from {model_dict['max_seq_len']} to training.seq_len = "
                        f"{train['seq_len']} (torchtitan sizes the rotary table from seq_len)")
        model_dict["max_seq_len"] = train["seq_len"]
    job = make_job(f, name=Path(source).stem, model=model_dict, strategy=strategy, train=train,
                   device=options.device or "h100")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _model(f: Fields, options: ReadOptions, warnings: list[str]) -> ModelConfig:
    name = f.get("model.name", str, "llama3")
    flavor = f.get("model.flavor", str, "debugmodel", ir="model")
    if options.model is not None:
        return options.model
    known = flavors.model_of(name, flavor)
    if known is not None:
        return from_dict(ModelConfig, {**known, "name": flavor}, "model")
    ref = FLAVORS.get((name, flavor), flavor)
    if not (CONFIG_ROOT / "models" / f"{ref}.yaml").is_file():
        raise f.error("model.flavor", f"{name} / {flavor!r} is a torchtitan flavor with no ms_llm model file; pass "
                                      "--model NAME (configs/models) or --model path/to/model.yaml")
    if f.has("model.converters") and f.raw("model.converters"):
        warnings.append(f"model.converters = {f.raw('model.converters')!r}: model converters (float8, ...) are not "
                        "modelled")
    return load_section("model", ref)


def _world(f: Fields, given: int | None, rep: int, shard: int, cp: int, tp: int, pp: int) -> int:
    par = "parallelism"
    fixed = rep * cp * tp * pp
    if shard == -1:
        if given is None:
            raise f.error(f"{par}.data_parallel_shard_degree", "-1 takes the ranks left over, so the world size is "
                                                               "needed; pass --world-size N (NGPU in run_train.sh)")
        if given % fixed:
            raise f.error(f"{par}.data_parallel_shard_degree", f"-1 cannot be resolved: world size {given} is not "
                          f"divisible by replicate*cp*tp*pp = {rep}*{cp}*{tp}*{pp}")
        return given
    if shard < 1:
        raise f.error(f"{par}.data_parallel_shard_degree", f"got {shard}; use -1 or a degree >= 1")
    world = fixed * shard
    if given is not None and given != world:
        raise ConversionError(f"{f.source}: [parallelism] replicate*shard*cp*tp*pp = {rep}*{shard}*{cp}*{tp}*{pp} "
                              f"= {world}, but the world size is {given} (torchtitan's ParallelDims asserts they "
                              "match); set data_parallel_shard_degree = -1 or change a degree")
    return world


def _precision(f: Fields, fsdp: bool, tp: int, pp: int, warnings: list[str]) -> dict:
    param = f.get("training.mixed_precision_param", ("bfloat16", "float32"), "bfloat16",
                  ir="strategy.precision.param_dtype")
    reduce = f.get("training.mixed_precision_reduce", ("float32",), "float32",
                   ir="strategy.precision.grad_reduce_dtype")
    master = f.get("training.dtype", ("float32", "bfloat16"), "float32", ir="strategy.precision.master_dtype")
    if not fsdp and (tp > 1 or pp > 1) and param != "float32":
        warnings.append("torchtitan applies mixed precision only through FSDP (dp_shard * cp > 1) or under plain "
                        "DDP; with tp/pp and no FSDP it trains in float32, and so does this conversion")
        param = "float32"
    return {"param_dtype": param, "compute_dtype": param, "master_dtype": master, "grad_reduce_dtype": reduce}


def _batch(f: Fields, dp: int, pp: int) -> dict:
    key = "training.local_batch_size" if f.has("training.local_batch_size") or not f.has("training.batch_size") \
        else "training.batch_size"
    local = f.get(key, int, 8, ir="train.micro_batch_size")
    mbs = f.get("parallelism.pipeline_parallel_microbatch_size", int, 1, ir="train.micro_batch_size") \
        if pp > 1 else local
    if local % mbs:
        raise f.error("parallelism.pipeline_parallel_microbatch_size", f"{mbs} does not divide "
                      f"training.local_batch_size = {local} (torchtitan refuses it)")
    gbs = f.get("training.global_batch_size", int, -1, ir="train.global_batch_size")
    gbs = local * dp if gbs < 1 else gbs
    if gbs % (local * dp):
        raise f.error("training.global_batch_size", f"{gbs} is not a multiple of local_batch_size * dp = "
                                                    f"{local}*{dp} (gradient accumulation needs whole steps)")
    seed = f.get("training.seed", int, None, ir="train.seed")
    seed = f.get("debug.seed", int, seed if seed is not None else 1234, ir="train.seed")
    compile_key = "compile.enable" if f.has("compile.enable") or not f.has("training.compile") else "training.compile"
    train = {"global_batch_size": gbs, "micro_batch_size": mbs, "seed": seed,
             "compile": f.get(compile_key, bool, False, ir="train.compile"),
             "seq_len": f.get("training.seq_len", int, 2048, ir="train.seq_len"),
             "steps": f.get("training.steps", int, 10000, ir="train.steps"),
             "log_every": f.get("metrics.log_freq", int, 10, ir="train.log_every")}
    return train


def fqn_parts(num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Layers per model part as torchtitan's generate_llm_fqn_per_model_part assigns them: the
    embedding counts as `input_weight` layers of the first part, norm + output as `output_weight`
    of the last, and the effective layers are spread evenly (earlier parts take the remainder)."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, num_stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise ConversionError(f"{num_stages} pipeline parts cannot hold {num_layers} layers with first/last stage "
                              f"weights {input_weight}/{output_weight}")
    counts, left = [], num_layers
    for i in range(num_stages):
        n = per + (1 if i < extra else 0) - (input_weight if i == 0 else 0) \
            - (output_weight if i == num_stages - 1 else 0)
        n = max(0, min(n, left))
        counts.append(n)
        left -= n
    return counts


def _pipeline(f: Fields, layers: int, pp: int) -> dict:
    par = "parallelism"
    raw = f.get(f"{par}.pipeline_parallel_schedule", str, "1F1B", ir="strategy.pipeline.schedule")
    key = raw.lower().replace("_", "")
    if key not in SCHEDULES:
        raise f.error(f"{par}.pipeline_parallel_schedule", f"{raw!r} is not a torch.distributed.pipelining schedule "
                      "this conversion knows (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble)")
    if pp == 1:
        return {"schedule": "1f1b", "virtual_stages": 1}
    schedule = SCHEDULES[key]
    first = f.get(f"{par}.pipeline_parallel_first_stage_less_layers", int, 1)
    last = f.get(f"{par}.pipeline_parallel_last_stage_less_layers", int, 1)
    parts = f.raw(f"{par}.module_fqns_per_model_part", None, ir="strategy.pipeline.layer_split")
    per_stage = f.get(f"{par}.pipeline_parallel_layers_per_stage", int, 0, ir="strategy.pipeline.virtual_stages")
    if parts is not None:
        split = _split_from_fqns(f, parts, layers)
    else:
        if per_stage:
            stages = math.ceil((layers + first + last) / per_stage)
        else:
            stages = pp * (1 if key in SINGLE_STAGE else 2)
        split = fqn_parts(stages, layers, first, last)
    if len(split) % pp:
        raise f.error(f"{par}.pipeline_parallel_layers_per_stage", f"{len(split)} model parts do not divide over "
                      f"pipeline_parallel_degree = {pp}")
    vpp = len(split) // pp
    if key in SINGLE_STAGE and vpp != 1:
        raise f.error(f"{par}.pipeline_parallel_schedule", f"{raw} runs one stage per rank, but there are {vpp}")
    return {"schedule": schedule, "virtual_stages": vpp, "layer_split": split}


def _split_from_fqns(f: Fields, parts: object, layers: int) -> list[int]:
    key = "parallelism.module_fqns_per_model_part"
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
        raise f.error(key, "expected a list of lists of module names")
    split, expected = [], 0
    for i, part in enumerate(parts):
        ids = [int(m.group(1)) for name in part if (m := re.fullmatch(r"layers\.(\d+)", str(name)))]
        if ids != list(range(expected, expected + len(ids))):
            raise f.error(key, f"part {i} holds layers {ids}; ms_llm needs consecutive layers in model order")
        if ("tok_embeddings" in part) != (i == 0) or (("norm" in part or "output" in part) != (i == len(parts) - 1)):
            raise f.error(key, "tok_embeddings must be in the first part and norm / output in the last")
        expected += len(ids)
        split.append(len(ids))
    if expected != layers:
        raise f.error(key, f"lists {expected} layers; the model has {layers}")
    return split


def _recompute(f: Fields, layers: int, pp: int, warnings: list[str]) -> dict:
    ac = "activation_checkpoint"
    mode = f.get(f"{ac}.mode", ("none", "selective", "full", "memory_budget"), "selective",
                 ir="strategy.recompute.policy")
    option = str(f.raw(f"{ac}.selective_ac_option", "2", ir="strategy.recompute.num_layers"))
    if mode == "none":
        return {}
    if mode == "full":
        return {"policy": "full"}
    if mode == "memory_budget":
        warnings.append(f"{ac}.mode = memory_budget: read as selective recompute")
        return {"policy": "selective"}
    if option == "op":
        return {"policy": "selective"}
    if not option.isdigit() or int(option) < 1:
        raise f.error(f"{ac}.selective_ac_option", f"got {option!r}; expected 'op' or a positive layer interval")
    every = int(option)
    if every == 1:
        return {"policy": "full"}
    count = max(1, layers // pp // every)
    warnings.append(f"{ac}.selective_ac_option = {option}: full recompute of one layer in {every}, read as full "
                    f"recompute of the first {count} layers of each pipeline stage (the same number of layers)")
    return {"policy": "full", "num_layers": count}


def _optimizer(f: Fields, warnings: list[str]) -> dict:
    name = f.get("optimizer.name", str, "AdamW", ir="train.optimizer.name")
    if name not in ("AdamW", "Adam"):
        warnings.append(f"optimizer.name = {name}: read as AdamW")
    lr = f.get("optimizer.lr", float, 8e-4, ir="train.optimizer.lr")
    # weight_decay_1d: one AdamW group over model.parameters(), every parameter decays (a 0.3 registered
    # config may set param_groups by name pattern; the command line reaches the first only).
    opt = {"name": "adamw", "lr": lr, "eps": f.get("optimizer.eps", float, 1e-8, ir="train.optimizer.eps"),
           "weight_decay": f.get("optimizer.weight_decay", float, 0.1, ir="train.optimizer.weight_decay"),
           "weight_decay_1d": True,
           "beta1": f.get("optimizer.beta1", float, 0.9, ir="train.optimizer.beta1"),
           "beta2": f.get("optimizer.beta2", float, 0.95, ir="train.optimizer.beta2"),
           "grad_clip": f.get("training.max_norm", float, 1.0, ir="train.optimizer.grad_clip")}
    ls = "lr_scheduler"
    decay = f.get(f"{ls}.decay_type", tuple(DECAY), "linear", ir="train.schedule.decay")
    if decay == "sqrt":
        warnings.append(f"{ls}.decay_type = sqrt: read as linear decay")
    if f.raw(f"{ls}.decay_ratio") is not None:
        warnings.append(f"{ls}.decay_ratio = {f.raw(ls + '.decay_ratio')}: the warmup-stable-decay plateau is not "
                        "modelled; the decay starts after warmup")
    key = f"{ls}.lr_min" if f.has(f"{ls}.lr_min") else f"{ls}.min_lr_factor"
    schedule = {"warmup_steps": f.get(f"{ls}.warmup_steps", int, 200, ir="train.schedule.warmup_steps"),
                "decay": DECAY[decay], "min_lr_ratio": f.get(key, float, 0.0, ir="train.schedule.min_lr_ratio")}
    return {"optimizer": opt, "schedule": schedule}


def _checkpoint(f: Fields, warnings: list[str]) -> dict:
    ck = "checkpoint"
    key = f"{ck}.enable" if f.has(f"{ck}.enable") or not f.has(f"{ck}.enable_checkpoint") else f"{ck}.enable_checkpoint"
    on = f.get(key, bool, False, ir="train.checkpoint.interval")
    interval = f.get(f"{ck}.interval", int, 500, ir="train.checkpoint.interval")
    mode = f.get(f"{ck}.async_mode", ("disabled", "async", "async_with_pinned_mem"), "disabled",
                 ir="train.checkpoint.async_save")
    out: dict = {"interval": interval if on else 0, "async_save": mode != "disabled"}
    keep = f.get(f"{ck}.keep_latest_k", int, 10, ir="train.checkpoint.keep_last")
    if keep == 0:
        warnings.append(f"{ck}.keep_latest_k = 0 keeps every checkpoint; ms_llm keeps a bounded number (10 used)")
        keep = 10
    out["keep_last"] = keep
    load = f.get(f"{ck}.initial_load_path", str, "", ir="train.checkpoint.load")
    if load:
        out["load"] = load
    return out
