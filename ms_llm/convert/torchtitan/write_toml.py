"""IR -> a torchtitan v0.2.x job TOML (the format of its models/llama3/train_configs/*.toml),
which torchtitan.read reads back to the same IR. TOML is written by hand: the format is flat
sections of scalars and lists."""
from __future__ import annotations

import json

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import DataConfig
from ms_llm.convert.common import Written, cp_algorithm
from ms_llm.convert.torchtitan import flavors
from ms_llm.convert.torchtitan.read import FLAVORS, ROTATE_METHODS, fqn_parts
from ms_llm.job import JobConfig, load_section

SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B",
                  "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "rope_theta", "rope_scaling", "head_dim", "qkv_bias", "qk_norm", "norm_eps", "tie_embeddings", "moe")


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def toml_dumps(sections: dict[str, dict], header: str = "") -> str:
    lines = [header] if header else []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _flavor(m: ModelConfig, warnings: list[str]) -> tuple[str, str]:
    known = flavors.match(m, warnings) if m.moe is not None else None
    if known is not None:
        module, flavor, depth = flavors.REGISTERED[known[1]]
        if depth:
            warnings.append(f"model.mtp_layers = {m.mtp_layers}: a v0.2.x job names the {flavor} flavor, which has "
                            f"no MTP modules (torchtitan 0.3's {known[1]} has them: --to torchtitan); not written")
        return module, flavor
    for (name, flavor), ref in FLAVORS.items():
        known = load_section("model", ref)
        if all(getattr(known, k) == getattr(m, k) for k in SHAPE_FIELDS):
            return name, flavor
    warnings.append(f"model: no torchtitan flavor has this shape; flavor = {m.name!r} written (register it in "
                    "torchtitan's flavors; ms_llm reads it back from configs/models or --model)")
    return "deepseek_v3" if m.mla is not None else "llama3", m.name


def write(job: JobConfig, world_size: int) -> Written:
    sections, expressed, warnings = job_sections(job)
    name, flavor = _flavor(job.model, warnings)
    sections = {"job": sections.pop("job"), "model": {"name": name, "flavor": flavor}, **sections}
    if job.strategy.cp > 1:
        algorithm = cp_algorithm(job, "torchtitan's context_parallel_rotate_method", warnings)
        if algorithm == "ulysses":
            warnings.append("strategy.context_parallel.algorithm = ulysses: torchtitan's context parallel rotates K/V "
                            "(allgather or alltoall, a ring), it has no all-to-all over heads; allgather written")
        rotate = {a: m for m, a in ROTATE_METHODS.items()}.get(algorithm, "allgather")
        sections["parallelism"]["context_parallel_rotate_method"] = rotate
    header = (f"# {job.name}: {job.model.name} on {world_size} GPUs; written by ms-llm convert-strategy.\n"
              f"# torchtitan v0.2.x job config: NGPU={world_size} ./run_train.sh --job.config_file <this file>\n")
    return Written(toml_dumps(sections, header), expressed, warnings)


def job_sections(job: JobConfig) -> tuple[dict, set[str], list[str]]:
    """The job as torchtitan's config sections (v0.2.x names; torchtitan_job.py renames 0.3's few
    changes), the model aside (a v0.2.x flavor or a 0.3 registered config), the IR paths they carry,
    and what they cannot say."""
    m, s, t = job.model, job.strategy, job.train
    warnings: list[str] = []
    expressed = {"model", "strategy.dp", "strategy.tp", "strategy.pp", "strategy.cp", "strategy.ep", "strategy.etp",
                 "strategy.zero.stage", "strategy.zero.shard_size", "strategy.pipeline", "strategy.recompute",
                 "strategy.precision", "strategy.offload", "strategy.sequence_parallel", "train",
                 "strategy.context_parallel"}
    if m.flash_attention:
        warnings.append("model.flash_attention = True: torchtitan's attention is SDPA, which picks the flash kernel "
                        "itself; no field written")
    o, sch, ck, p = t.optimizer, t.schedule, t.checkpoint, s.precision
    if o.name != "adamw":
        warnings.append(f"train.optimizer.name = {o.name}: torchtitan configs name AdamW; AdamW written")
    # With pipeline parallel the whole per-rank batch is one local batch cut into micro-batches;
    # without it, each micro-batch is a local batch and the rest is gradient accumulation.
    training: dict = {"local_batch_size": t.global_batch_size // s.dp if s.pp > 1 else t.micro_batch_size,
                      "global_batch_size": t.global_batch_size, "seq_len": t.seq_len, "max_norm": o.grad_clip,
                      "steps": t.steps, "seed": t.seed,
                      "dtype": p.master_dtype if p.master_dtype != "float16" else "float32",
                      "mixed_precision_param": "float32" if p.param_dtype == "float32" else "bfloat16",
                      "mixed_precision_reduce": "float32"}
    _precision_notes(s, warnings)
    if s.offload.optimizer or s.offload.params:
        training["enable_cpu_offload"] = True
        if not (s.offload.optimizer and s.offload.params):
            warnings.append("strategy.offload: FSDP2's CPU offload moves parameters, gradients and optimizer states "
                            "together; enable_cpu_offload written")
    parallel = _parallelism(s, warnings)
    if s.pp > 1:
        parallel.update(_pipeline(m, s, t))
    sections = {"job": {"description": job.name},
                "optimizer": {"name": "AdamW", "lr": o.lr, "eps": o.eps, "weight_decay": o.weight_decay,
                              "beta1": o.beta1, "beta2": o.beta2},
                "lr_scheduler": {"warmup_steps": sch.warmup_steps, "decay_type": sch.decay,
                                 "min_lr_factor": sch.min_lr_ratio},
                "training": training, "parallelism": parallel,
                "compile": {"enable": t.compile},
                "checkpoint": _checkpoint(ck, warnings),
                "activation_checkpoint": _recompute(s, _largest_stage(m, s), warnings),
                "metrics": {"log_freq": t.log_every}}
    if sch.decay == "constant":
        warnings.append("train.schedule.decay = constant: torchtitan decays linearly, cosine or sqrt; written as "
                        "linear with min_lr_factor 1.0")
        sections["lr_scheduler"].update(decay_type="linear", min_lr_factor=1.0)
    if sch.warmup_steps and sch.warmup_from_zero:
        warnings.append("train.schedule.warmup_from_zero = true: torchtitan's warmup runs update k at "
                        "lr*k/warmup_steps, one update ahead of a warmup from 0")
    if t.data != DataConfig():
        warnings.append("train.data: torchtitan names datasets in [training] dataset; not written")
    if not o.weight_decay_1d:
        warnings.append("train.optimizer.weight_decay_1d = false: torchtitan's AdamW decays every parameter (0.3's "
                        "param_groups can exempt some by name pattern, in a registered config only); biases and "
                        "norm weights will decay")
    return sections, expressed, warnings


def _precision_notes(s, warnings: list[str]) -> None:
    p = s.precision
    if p.param_dtype != p.compute_dtype:
        warnings.append(f"strategy.precision: params {p.param_dtype} / compute {p.compute_dtype}; torchtitan computes "
                        "in mixed_precision_param")
    if p.loss_scale != "none" or "float16" in (p.param_dtype, p.compute_dtype, p.master_dtype):
        warnings.append("strategy.precision: torchtitan trains in bfloat16 or float32 without loss scaling; "
                        "float16 is written as bfloat16 (float32 for the master copy), the loss scale is dropped")
    if p.grad_reduce_dtype != "float32":
        warnings.append(f"strategy.precision.grad_reduce_dtype = {p.grad_reduce_dtype}: torchtitan reduces "
                        "gradients in float32 (mixed_precision_reduce)")
    if s.zero.stage != 3 and p.param_dtype != "float32" and (s.tp > 1 or s.pp > 1) and s.cp == 1:
        warnings.append("strategy.precision: without FSDP, torchtitan runs tp/pp in float32 (mixed precision "
                        "needs data_parallel_shard_degree * context_parallel_degree > 1)")


def _parallelism(s, warnings: list[str]) -> dict:
    stage = s.zero.stage
    shard = s.dp if s.zero.shard_size in (-1, s.dp) else s.zero.shard_size
    if stage in (1, 2):
        warnings.append(f"strategy.zero.stage = {stage}: torchtitan shards with FSDP2 only (ZeRO-3); written as FSDP")
    if stage == 0:
        shard = 1
        if s.cp > 1:
            warnings.append("strategy.zero.stage = 0 with cp > 1: torchtitan always shards over dp_shard * cp "
                            "(FSDP over the cp ranks)")
    rep = s.dp // shard
    out: dict = {"data_parallel_replicate_degree": rep,
                 "data_parallel_shard_degree": -1 if rep == 1 and shard > 1 else shard,
                 "tensor_parallel_degree": s.tp, "pipeline_parallel_degree": s.pp,
                 "context_parallel_degree": s.cp, "expert_parallel_degree": s.ep}
    if s.ep > 1 and s.expert_tp != 1:
        warnings.append(f"strategy.etp = {s.etp}: torchtitan keeps experts whole under expert parallel (ep borrows "
                        "the tp ranks, ms_llm's etp 1); written so")
    if s.tp > 1 and not s.sequence_parallel:
        warnings.append("strategy.sequence_parallel = false: torchtitan's tensor parallel plan always shards the "
                        "norms over the sequence")
    if s.zero.engine != "auto":
        warnings.append(f"strategy.zero.engine = {s.zero.engine}: torchtitan runs FSDP2")
    return out


def _pipeline(m, s, t) -> dict:
    pipe = s.pipeline
    chunks = s.pp * pipe.virtual_stages
    split = list(pipe.layer_split) if pipe.layer_split else [m.num_layers // chunks] * chunks
    parts, start = [], 0
    for i, n in enumerate(split):
        part = (["tok_embeddings"] if i == 0 else []) + [f"layers.{l}" for l in range(start, start + n)]
        parts.append(part + (["norm", "output"] if i == chunks - 1 else []))
        start += n
    out = {"pipeline_parallel_schedule": SCHEDULE_NAMES[pipe.schedule],
           "pipeline_parallel_microbatch_size": t.micro_batch_size}
    default_chunks = s.pp * (1 if pipe.schedule in ("1f1b", "gpipe") else 2)
    if chunks != default_chunks or split != fqn_parts(chunks, m.num_layers):
        out["module_fqns_per_model_part"] = parts       # torchtitan's own split would differ
    return out


def _largest_stage(m, s) -> int:
    """The most layers one pipeline rank holds (its chunks together)."""
    chunks = s.pp * s.pipeline.virtual_stages
    split = s.pipeline.layer_split or [m.num_layers // chunks] * chunks
    return max(sum(split[r::s.pp]) for r in range(s.pp))


def _checkpoint(ck, warnings: list[str]) -> dict:
    if ck.interval == "auto":
        warnings.append("train.checkpoint.interval = 'auto': torchtitan needs a step interval; checkpointing off")
    out: dict = {"enable": isinstance(ck.interval, int) and ck.interval > 0,
                 "async_mode": "async" if ck.async_save else "disabled", "keep_latest_k": max(2, ck.keep_last)}
    if ck.keep_last == 1:
        warnings.append("train.checkpoint.keep_last = 1: torchtitan keeps at least 2 (the newest may still be "
                        "saving); 2 written")
    if out["enable"]:
        out["interval"] = ck.interval
    if ck.load:
        out["initial_load_path"] = ck.load
    if ck.memory_tier:
        warnings.append("train.checkpoint.memory_tier: torchtitan has no in-memory checkpoint tier")
    return out


def _recompute(s, layers_per_stage: int, warnings: list[str]) -> dict:
    rc = s.recompute
    if rc.policy == "none":
        return {"mode": "none"}
    if rc.policy == "selective":
        if rc.num_layers != -1:
            warnings.append(f"strategy.recompute.num_layers = {rc.num_layers}: torchtitan's op-level selective "
                            "recompute covers every layer")
        return {"mode": "selective", "selective_ac_option": "op"}
    if rc.num_layers == -1:
        return {"mode": "full"}
    every = max(1, layers_per_stage // rc.num_layers)
    if layers_per_stage // every != rc.num_layers:
        warnings.append(f"strategy.recompute.num_layers = {rc.num_layers}: torchtitan recomputes one layer in N; "
                        f"one in {every} written ({layers_per_stage // every} layers per stage)")
    return {"mode": "selective", "selective_ac_option": str(every)}
