"""DeepSpeed JSON config <-> IR.

A DeepSpeed config holds no model shape (pass --model) and no sequence length. Its degrees are
`tensor_parallel.autotp_size`, `pipeline.stages`, `sequence_parallel_size` (DeepSpeed-Ulysses:
context parallel with the ulysses algorithm) and AutoEP's `expert_parallel.autoep_size` (ep; the
experts are the --model's: DeepSpeed MoE layers are built in model code, not in the config); dp
is the rest of the world. The batch triple is resolved as DeepSpeed's
config.py does: train_batch_size = micro_batch * gradient_accumulation * dp, any two give the
third, one alone means gradient_accumulation_steps = 1; with all three given and no --world-size,
dp (hence the world size) follows from them. Absent keys take DeepSpeed's defaults: no gradient
clipping, no lr schedule, gradients reduced in the training dtype. Which parameters decay is not the
config's to say: DeepSpeed decays whatever param groups the training script hands it, so a config
reads as decay on every parameter (train.optimizer.weight_decay_1d true, the plain
model.parameters() case), and false is written as a warning for the script's author.
"""
from __future__ import annotations

import json
import math

from ms_llm.config.schema import to_dict
from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, Written, make_job
from ms_llm.job import JobConfig

BUCKET_BYTES = 2                 # DeepSpeed buckets count elements; ms_llm sizes them in MiB of 16-bit grads
MIB = 2 ** 20
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def read(text: str, source: str, options: ReadOptions) -> Converted:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{source}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{source}: expected a JSON object of DeepSpeed settings, got {type(data).__name__}")
    if options.model is None:
        raise ConversionError(f"{source}: a DeepSpeed config holds no model shape; pass --model NAME "
                              "(a file in configs/models, e.g. llama2_7b) or --model path/to/model.yaml")
    f = Fields(data, source)
    warnings: list[str] = []
    model = options.model
    tp = f.get("tensor_parallel.autotp_size", int, 1, ir="strategy.tp")
    stages = f.raw("pipeline.stages", 1, ir="strategy.pp")
    if stages == "auto":
        warnings.append("pipeline.stages = 'auto': the stage count is set by PipelineModule(num_stages=...) in "
                        "the training script; pp = 1 assumed")
        stages = 1
    pp = f.get("pipeline.stages", int) if stages != 1 else 1
    cp = f.get("sequence_parallel_size", int, 1, ir="strategy.cp")
    world = options.world_size
    dp = None
    if world:
        if world % (tp * pp * cp):
            raise ConversionError(f"{source}: world size {world} is not divisible by autotp_size * pipeline.stages "
                                  f"* sequence_parallel_size = {tp}*{pp}*{cp}; pass another --world-size")
        dp = world // (tp * pp * cp)
    gbs, mbs, dp = _batch(f, dp, warnings)
    world = dp * tp * pp * cp
    strategy = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": _expert_parallel(f, model),
                "context_parallel": {"algorithm": "ulysses" if cp > 1 else "auto"}, "zero": _zero(f, warnings),
                "precision": _precision(f), "recompute": _recompute(f, warnings)}
    strategy["offload"] = strategy["zero"].pop("offload")
    if pp > 1 and f.get("pipeline.partition", str, "best") != "uniform":
        warnings.append(f"pipeline.partition = {f.get('pipeline.partition', str, 'best')!r}: read as an "
                        "even split of the layers (uniform)")
    if pp > 1 and model.num_layers % pp:
        strategy["pipeline"] = {"layer_split": uniform_split(model.num_layers, pp)}
    model_dict = {**to_dict(model, full=True), "dtype": strategy["precision"]["param_dtype"]}
    train = {"global_batch_size": gbs, "micro_batch_size": mbs, "seq_len": model.max_seq_len,
             "log_every": f.get("steps_per_print", int, 10, ir="train.log_every"),
             "optimizer": _optimizer(f, warnings)}
    warnings.append(f"train.seq_len: a DeepSpeed config has none; the model's max_seq_len {model.max_seq_len} is used")
    schedule, steps = _schedule(f, train["optimizer"], warnings)
    train["schedule"] = schedule
    if steps is not None:
        train["steps"] = steps
    job = make_job(f, name=source.rsplit("/", 1)[-1].rsplit(".", 1)[0], model=model_dict, strategy=strategy,
                   train=train, device=options.device or "h100")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _expert_parallel(f: Fields, model) -> int:
    """AutoEP's expert_parallel section: autoep_size is ep; the experts themselves are the model's
    (--model), which a DeepSpeed config does not describe."""
    if not f.get("expert_parallel.enabled", bool, False, ir="strategy.ep"):
        return 1
    if model.moe is None:
        raise f.error("expert_parallel.enabled", f"AutoEP needs an MoE model; --model {model.name} is dense")
    f.accept_usual({"top_k": ("auto", model.moe.top_k)}, "expert_parallel.")
    return f.get("expert_parallel.autoep_size", int, 1, ir="strategy.ep")


def _batch_value(f: Fields, key: str, warnings: list[str]) -> int | None:
    if f.raw(key) == "auto":
        warnings.append(f"{key} = 'auto' (filled in by the Hugging Face Trainer): treated as unset")
        return None
    value = f.get(key, int, None)
    if value is not None and value < 1:
        raise f.error(key, f"got {value}; must be >= 1")
    return value


def uniform_split(layers: int, parts: int) -> list[int]:
    """Layers per stage as DeepSpeed's partition_uniform cuts them: the first layers % parts stages
    take one more."""
    each, extra = divmod(layers, parts)
    return [each + (i < extra) for i in range(parts)]


def _batch(f: Fields, dp: int | None, warnings: list[str]) -> tuple[int, int, int]:
    """(global batch, micro batch, dp) from DeepSpeed's batch triple."""
    tbs = _batch_value(f, "train_batch_size", warnings)
    mbs = _batch_value(f, "train_micro_batch_size_per_gpu", warnings)
    gas = _batch_value(f, "gradient_accumulation_steps", warnings)
    f.sources.update({"train.global_batch_size": "train_batch_size",
                      "train.micro_batch_size": "train_micro_batch_size_per_gpu",
                      "strategy.pipeline.micro_batches": "gradient_accumulation_steps"})
    triple = f"train_batch_size={tbs}, train_micro_batch_size_per_gpu={mbs}, gradient_accumulation_steps={gas}"
    if tbs and mbs and gas:
        if dp is None:
            if tbs % (mbs * gas):
                raise f.error("train_batch_size", f"{triple}: {tbs} is not a multiple of {mbs}*{gas}")
            return tbs, mbs, tbs // (mbs * gas)
        if tbs != mbs * gas * dp:
            raise f.error("train_batch_size", f"{triple} but micro * accumulation * dp = {mbs}*{gas}*{dp} = "
                                              f"{mbs * gas * dp}; fix one of the three (or the world size)")
        return tbs, mbs, dp
    if tbs is None and mbs is None:
        raise f.error("train_batch_size", "neither it nor train_micro_batch_size_per_gpu is set; DeepSpeed needs one")
    if dp is None:
        raise ConversionError(f"{f.source}: the batch triple ({triple}) does not fix dp; pass --world-size N")
    gas = gas or (1 if tbs is None or mbs is None else None)
    if tbs is None:
        return mbs * gas * dp, mbs, dp
    if mbs is None:
        if tbs % (gas * dp):
            raise f.error("train_batch_size", f"{tbs} is not divisible by gradient_accumulation_steps * dp = "
                                              f"{gas}*{dp}")
        return tbs, tbs // (gas * dp), dp
    if tbs % (mbs * dp):
        raise f.error("train_batch_size", f"{tbs} is not divisible by micro batch * dp = {mbs}*{dp}")
    return tbs, mbs, dp


def _zero(f: Fields, warnings: list[str]) -> dict:
    z = "zero_optimization"
    zero: dict = {"stage": f.get(f"{z}.stage", int, 0, ir="strategy.zero.stage")}
    elements = f.get(f"{z}.reduce_bucket_size", float, 5e8, ir="strategy.zero.bucket_mb")
    gather = f.get(f"{z}.allgather_bucket_size", float, elements)
    if gather != elements:
        warnings.append(f"{z}.allgather_bucket_size = {gather:g} differs from reduce_bucket_size = {elements:g}; "
                        "ms_llm has one bucket size (the reduce bucket's)")
    zero["bucket_mb"] = elements * BUCKET_BYTES / MIB
    mics = f.get(f"{z}.mics_shard_size", int, -1, ir="strategy.zero.shard_size")
    hpz = f.get(f"{z}.zero_hpz_partition_size", int, 1, ir="strategy.zero.shard_size")
    if mics > 0:
        zero["shard_size"] = mics
    elif hpz > 1:
        zero["shard_size"] = hpz
        warnings.append(f"{z}.zero_hpz_partition_size = {hpz} (ZeRO++ secondary weight partition) read as hybrid "
                        f"sharding over groups of {hpz}; ZeRO++ still shards optimizer states over all of dp")
    offload = {}
    for key, field in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        device = f.get(f"{z}.{key}.device", ("none", "cpu", "nvme"), "none", ir=f"strategy.offload.{field}")
        if device == "nvme":
            warnings.append(f"{z}.{key}.device = nvme: read as host-memory offload")
        offload[field] = device != "none"
    zero["offload"] = offload
    return zero


def _precision(f: Fields) -> dict:
    bf16 = f.get("bf16.enabled", bool, False, ir="strategy.precision")
    fp16 = f.get("fp16.enabled", bool, False, ir="strategy.precision")
    if bf16 and fp16:
        raise f.error("fp16.enabled", "true together with bf16.enabled; DeepSpeed refuses both")
    dtype = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    reduce = f.get("communication_data_type", ("fp32", "fp16", "bf16"), None,
                   ir="strategy.precision.grad_reduce_dtype")
    prec = {"param_dtype": dtype, "compute_dtype": dtype, "master_dtype": "float32",
            "grad_reduce_dtype": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", None: dtype}[reduce]}
    if bf16 and f.get("bf16.bf16_master_weights_and_grads", bool, False, ir="strategy.precision.master_dtype"):
        prec["master_dtype"] = "bfloat16"
    if fp16:
        scale = f.get("fp16.loss_scale", float, 0.0, ir="strategy.precision.loss_scale")
        if scale > 0:
            prec.update(loss_scale="static", initial_loss_scale=scale)
        else:
            power = f.get("fp16.initial_scale_power", int, 16, ir="strategy.precision.initial_loss_scale")
            prec.update(loss_scale="dynamic", initial_loss_scale=2.0 ** power)
    return prec


def _recompute(f: Fields, warnings: list[str]) -> dict:
    interval = f.get("pipeline.activation_checkpoint_interval", int, 0, ir="strategy.recompute.policy")
    if interval > 1:
        warnings.append(f"pipeline.activation_checkpoint_interval = {interval}: one checkpoint per {interval} "
                        "layers, read as full recompute of every layer")
    if interval:
        return {"policy": "full"}
    if f.has("activation_checkpointing"):
        f.sources["strategy.recompute.policy"] = "activation_checkpointing"
        warnings.append("activation_checkpointing: DeepSpeed checkpoints what the model code wraps; read as full "
                        "recompute of every layer")
        return {"policy": "full"}
    return {}


def _optimizer(f: Fields, warnings: list[str]) -> dict:
    clip = f.get("gradient_clipping", float, 0.0, ir="train.optimizer.grad_clip")
    if not f.has("optimizer"):
        warnings.append("no optimizer section: the training script builds the optimizer; ms_llm's AdamW "
                        "defaults are used")
        return {"grad_clip": clip}
    kind = f.get("optimizer.type", str, ir="train.optimizer.name")
    if kind.lower() not in ("adam", "adamw", "fusedadam"):
        warnings.append(f"optimizer.type = {kind}: read as AdamW")
    p = "optimizer.params"
    betas = f.get(f"{p}.betas", list, [0.9, 0.999], ir="train.optimizer.beta1")
    if len(betas) != 2:
        raise f.error(f"{p}.betas", f"got {betas!r}; expected [beta1, beta2]")
    return {"name": "adamw", "lr": f.get(f"{p}.lr", float, 1e-3, ir="train.optimizer.lr"),
            "beta1": float(betas[0]), "beta2": float(betas[1]),
            "eps": f.get(f"{p}.eps", float, 1e-8, ir="train.optimizer.eps"),
            "weight_decay": f.get(f"{p}.weight_decay", float, 0.0, ir="train.optimizer.weight_decay"),
            "grad_clip": clip}


def _schedule(f: Fields, optimizer: dict, warnings: list[str]) -> tuple[dict, int | None]:
    if not f.has("scheduler"):
        return {"warmup_steps": 0, "decay": "constant"}, None
    kind = f.get("scheduler.type", tuple(SCHEDULERS), ir="train.schedule.decay")
    p = "scheduler.params"
    schedule = {"warmup_steps": f.get(f"{p}.warmup_num_steps", int, 1000, ir="train.schedule.warmup_steps"),
                "decay": SCHEDULERS[kind]}
    if f.has(f"{p}.warmup_max_lr"):
        optimizer["lr"] = f.get(f"{p}.warmup_max_lr", float, ir="train.optimizer.lr")
    if f.get(f"{p}.warmup_min_lr", float, 0.0) or f.get(f"{p}.warmup_min_ratio", float, 0.0):
        warnings.append("the warmup starts above zero; ms_llm warms up from 0")
    if f.get(f"{p}.warmup_type", ("log", "linear"), "log") == "log" and schedule["warmup_steps"]:
        warnings.append(f"{p}.warmup_type = log (DeepSpeed's default): ms_llm warms up linearly")
    if kind == "WarmupCosineLR":
        schedule["min_lr_ratio"] = f.get(f"{p}.cos_min_ratio", float, 0.0001, ir="train.schedule.min_lr_ratio")
    elif kind == "WarmupDecayLR":
        schedule["min_lr_ratio"] = 0.0
    steps = f.get(f"{p}.total_num_steps", int, ir="train.steps") if kind != "WarmupLR" else None
    return schedule, steps


def write(job: JobConfig, world_size: int) -> Written:
    m, s, t = job.model, job.strategy, job.train
    warnings = [f"model: a DeepSpeed config holds no model shape; read it back with --model (here {m.name})",
                f"train.seq_len = {t.seq_len}: a DeepSpeed config holds no sequence length"]
    expressed = {"model", "train.seq_len", "strategy.dp", "strategy.tp", "strategy.pp", "strategy.cp",
                 "strategy.context_parallel", "strategy.ep",
                 "strategy.pipeline.micro_batches", "strategy.zero", "strategy.offload", "strategy.precision",
                 "strategy.recompute.policy", "train.global_batch_size", "train.micro_batch_size", "train.log_every",
                 "train.optimizer", "train.schedule", "train.steps"}
    gas = t.global_batch_size // (t.micro_batch_size * s.dp)
    out: dict = {"train_batch_size": t.global_batch_size, "train_micro_batch_size_per_gpu": t.micro_batch_size,
                 "gradient_accumulation_steps": gas, "gradient_clipping": t.optimizer.grad_clip,
                 "steps_per_print": t.log_every}
    out.update(_write_precision(s.precision, warnings))
    out["zero_optimization"] = _write_zero(s, warnings)
    o = t.optimizer
    if o.name != "adamw":
        warnings.append(f"train.optimizer.name = {o.name}: DeepSpeed configs name Adam-family optimizers; "
                        "AdamW written")
    out["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                    "weight_decay": o.weight_decay}}
    if not o.weight_decay_1d:
        warnings.append("train.optimizer.weight_decay_1d = false: a DeepSpeed config cannot say it; the training "
                        "script's param groups must give biases and 1-D parameters (norm weights) weight_decay 0")
    out["scheduler"] = _write_schedule(t, warnings)
    if s.tp > 1:
        out["tensor_parallel"] = {"autotp_size": s.tp}
    if s.cp > 1:
        out["sequence_parallel_size"] = s.cp
        if s.context_parallel.algorithm != "ulysses":
            warnings.append(f"strategy.context_parallel.algorithm = {s.context_parallel.algorithm}: DeepSpeed's "
                            "sequence_parallel_size is DeepSpeed-Ulysses (all-to-all over heads); ulysses written")
    if s.ep > 1:
        out["expert_parallel"] = {"enabled": True, "autoep_size": s.ep}    # AutoEP (DeepSpeed >= 0.19)
    if s.sequence_parallel:
        warnings.append("strategy.sequence_parallel: DeepSpeed has no Megatron-style sequence parallel setting")
    if s.pp > 1:
        out["pipeline"] = {"stages": s.pp, "partition": "uniform"}
        if s.pipeline.schedule != "1f1b" or s.pipeline.virtual_stages > 1:
            warnings.append(f"strategy.pipeline.schedule = {s.pipeline.schedule} x{s.pipeline.virtual_stages}: "
                            "DeepSpeed's pipeline engine runs 1F1B with one chunk per stage")
        if s.pipeline.layer_split not in (None, tuple(uniform_split(m.num_layers, s.pp))):
            warnings.append(f"strategy.pipeline.layer_split = {list(s.pipeline.layer_split)}: DeepSpeed partitions "
                            "by method (uniform written)")
    rc = s.recompute
    if rc.policy == "selective":
        warnings.append("strategy.recompute.policy = selective: DeepSpeed checkpoints whole layers; nothing written")
    elif rc.policy == "full":
        if rc.num_layers != -1:
            warnings.append(f"strategy.recompute.num_layers = {rc.num_layers}: written as recompute of every layer")
        if s.pp > 1:
            out["pipeline"]["activation_checkpoint_interval"] = 1
        else:
            out["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                               "contiguous_memory_optimization": False}
    return Written(json.dumps(out, indent=2) + "\n", expressed, warnings)


def _write_precision(p, warnings: list[str]) -> dict:
    if p.param_dtype != p.compute_dtype:
        warnings.append(f"strategy.precision: params {p.param_dtype} / compute {p.compute_dtype}; DeepSpeed uses "
                        f"one training dtype ({p.compute_dtype} written)")
    out: dict = {}
    if p.compute_dtype == "bfloat16":
        out["bf16"] = {"enabled": True}
        if p.master_dtype == "bfloat16":
            out["bf16"]["bf16_master_weights_and_grads"] = True
    elif p.compute_dtype == "float16":
        out["fp16"] = {"enabled": True}
        if p.loss_scale == "static":
            out["fp16"]["loss_scale"] = p.initial_loss_scale
        else:
            power = math.log2(p.initial_loss_scale)
            if not power.is_integer():
                warnings.append(f"strategy.precision.initial_loss_scale = {p.initial_loss_scale:g}: DeepSpeed takes a "
                                f"power of two; 2**{round(power)} written")
            out["fp16"].update(loss_scale=0, initial_scale_power=round(power))
        if p.master_dtype != "float32":
            warnings.append("strategy.precision.master_dtype: DeepSpeed's fp16 optimizer keeps float32 master weights")
    if p.grad_reduce_dtype != p.compute_dtype:
        out["communication_data_type"] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[p.grad_reduce_dtype]
    return out


def _write_zero(s, warnings: list[str]) -> dict:
    z = s.zero
    elements = round(z.bucket_mb * MIB / BUCKET_BYTES)
    out: dict = {"stage": z.stage, "reduce_bucket_size": elements, "allgather_bucket_size": elements}
    if z.shard_size not in (-1, s.dp) and z.stage:
        if z.stage == 3:
            out["mics_shard_size"] = z.shard_size
        else:
            warnings.append(f"strategy.zero.shard_size = {z.shard_size}: DeepSpeed shards stage {z.stage} over all of "
                            "dp (MiCS hybrid sharding needs stage 3)")
    if s.offload.optimizer:
        out["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload.params:
        out["offload_param"] = {"device": "cpu", "pin_memory": True}
    if z.engine != "auto":
        warnings.append(f"strategy.zero.engine = {z.engine}: DeepSpeed runs its own ZeRO")
    return out


def _write_schedule(t, warnings: list[str]) -> dict:
    sch = t.schedule
    params: dict = {"warmup_num_steps": sch.warmup_steps, "warmup_type": "linear"}     # DeepSpeed's default is log
    if sch.warmup_steps and sch.warmup_from_zero:
        warnings.append("train.schedule.warmup_from_zero = true: DeepSpeed's Warmup*LR schedules have no setting for "
                        "where warmup starts; not written")
    if sch.decay == "constant":
        return {"type": "WarmupLR", "params": {**params, "warmup_min_lr": 0.0, "warmup_max_lr": t.optimizer.lr}}
    params["total_num_steps"] = t.steps
    if sch.decay == "linear":
        if sch.min_lr_ratio:
            warnings.append(f"train.schedule.min_lr_ratio = {sch.min_lr_ratio}: DeepSpeed's WarmupDecayLR decays to 0")
        return {"type": "WarmupDecayLR", "params": {**params, "warmup_min_lr": 0.0, "warmup_max_lr": t.optimizer.lr}}
    return {"type": "WarmupCosineLR", "params": {**params, "warmup_min_ratio": 0.0, "cos_min_ratio": sch.min_lr_ratio}}
