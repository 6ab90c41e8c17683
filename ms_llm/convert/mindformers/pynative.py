"""MindFormers' pynative trainer YAML (mindformers.pynative.config.TrainConfig: `training`,
`parallelism`, `model` without model_config, `lr_scheduler`, `checkpoint`, `recompute`) -> IR.

It is FSDP-shaped, like torchtitan: data_parallel_shard = -1 takes the ranks left after
tp * cp * pp (so the world size must be known), data_parallel_shard_strategy names what is
sharded (optim / optim_grads / optim_grads_params = ZeRO 1 / 2 / 3), the global batch is given and
the rest is gradient accumulation. The model keys are MindFormers 2.x's (mindformers_model.py).
"""
from __future__ import annotations

from pathlib import Path

from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, make_job
from ms_llm.convert.mindformers.data import read_data
from ms_llm.convert.mindformers.model import MCORE, read_dtypes, read_model
from ms_llm.convert.mindformers.train import OPTIMIZERS, read_schedule

SHARD_STRATEGIES = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
NEUTRAL = {"parallelism.context_parallel_method": ("colossal",), "parallelism.disable_gradient_division": (True,),
           "parallelism.reshard_after_forward_policy": ("default",), "parallelism.cpu_offload": (False,),
           "parallelism.pipeline_parallel_layers_per_stage": (None,), "parallelism.ulysses_degree_in_cp": (None,),
           "parallelism.context_parallel_async": (False,), "parallelism.context_parallel_mask_type": ("causal",),
           "training.deterministic": (True, False), "checkpoint.enable_save": (False,)}


def is_pynative(data: dict) -> bool:
    model = data.get("model")
    return ("training" in data or "parallelism" in data) and isinstance(model, dict) and "model_config" not in model


def read(data: dict, source: str, options: ReadOptions) -> Converted:
    f = Fields(data, source)
    warnings: list[str] = []
    f.accept_usual(NEUTRAL)
    model = read_model(f, MCORE, warnings, mc="model", given=options.model)
    par = "parallelism"
    tp = f.get(f"{par}.tensor_parallel", int, 1, ir="strategy.tp")
    cp = f.get(f"{par}.context_parallel", int, 1, ir="strategy.cp")
    pp = f.get(f"{par}.pipeline_parallel", int, 1, ir="strategy.pp")
    ep = f.get(f"{par}.expert_parallel", int, 1, ir="strategy.ep")
    shard = f.get(f"{par}.data_parallel_shard", int, -1, ir="strategy.dp")
    fixed = tp * cp * pp
    if shard == -1:
        if options.world_size is None or options.world_size % fixed:
            raise f.error(f"{par}.data_parallel_shard", f"-1 takes the ranks left after tensor*context*pipeline = "
                          f"{fixed}; pass --world-size N (a multiple of {fixed}), the device count msrun starts")
        shard = options.world_size // fixed
    world = shard * fixed
    if options.world_size and options.world_size != world:
        raise ConversionError(f"{source}: {par} gives {shard}*{tp}*{cp}*{pp} = {world} devices, not --world-size "
                              f"{options.world_size}; set data_parallel_shard: -1 or change a degree")
    stage = SHARD_STRATEGIES[f.get(f"{par}.data_parallel_shard_strategy", tuple(SHARD_STRATEGIES),
                                   "optim_grads_params", ir="strategy.zero.stage")]
    compute, stored = read_dtypes(f, MCORE, mc="model")
    precision = {"param_dtype": compute, "compute_dtype": compute, "master_dtype": stored,
                 "grad_reduce_dtype": "float32" if stored == "float32" else compute}
    model["dtype"] = compute
    vpp = f.get(f"{par}.pipeline_parallel_interleave_num", int, 1, ir="strategy.pipeline.virtual_stages")
    schedule = f.get(f"{par}.pipeline_parallel_schedule", str, "1f1b", ir="strategy.pipeline.schedule")
    if schedule.lower() != "1f1b":
        warnings.append(f"{par}.pipeline_parallel_schedule = {schedule}: read as 1F1B")
    strategy = {"dp": shard, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                "sequence_parallel": f.get(f"{par}.sequence_parallel", bool, False, ir="strategy.sequence_parallel")
                and tp > 1, "zero": {"stage": stage} if shard * cp > 1 else {},
                "pipeline": {"schedule": "interleaved_1f1b" if vpp > 1 else "1f1b", "virtual_stages": vpp},
                "recompute": _recompute(f, model["num_layers"], warnings), "precision": precision}
    train = _train(f, shard, model, warnings)
    job = make_job(f, name=Path(source).stem, model={**model, "name": Path(source).stem}, strategy=strategy,
                   train=train, device=options.device or "910b", backend="mindspore")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _recompute(f: Fields, layers: int, warnings: list[str]) -> dict:
    mode = str(f.get("recompute.mode", str, "None", ir="strategy.recompute.policy"))
    if mode == "full":
        ranges = f.get("recompute.full_recompute_layer", list, None)
        if ranges not in (None, [f"0-{layers - 1}"]):
            warnings.append(f"recompute.full_recompute_layer = {ranges!r}: read as full recompute of every layer")
        return {"policy": "full"}
    if mode == "select":
        warnings.append("recompute.select_module: read as ms_llm's selective policy")
        return {"policy": "selective"}
    return {}


def _decays_1d(f: Fields, warnings: list[str]) -> bool:
    """get_param_groups exempts 1-D parameters and biases, unless optimizer.weight_decay_include names
    them (exact names, substrings or wildcards; it wins over weight_decay_exclude): a rule '*' decays
    every parameter. Other rules pick parameters by name, which ms_llm does not."""
    include = f.get("optimizer.weight_decay_include", list, [], ir="train.optimizer.weight_decay_1d")
    exclude = f.get("optimizer.weight_decay_exclude", list, [], ir="train.optimizer.weight_decay_1d")
    every = "*" in include
    named = [f"weight_decay_{kind} {rules}" for kind, rules in (("include", [r for r in include if r != "*"]),
                                                                ("exclude", [] if every else exclude)) if rules]
    if named:
        warnings.append(f"optimizer.{' and '.join(named)}: per-name decay rules are not modelled; ms_llm "
                        f"{'decays every parameter' if every else 'exempts exactly the 1-D parameters and biases'}")
    return every


def _train(f: Fields, dp: int, model: dict, warnings: list[str]) -> dict:
    t = "training"
    local = f.get(f"{t}.local_batch_size", int, 1, ir="train.micro_batch_size")
    gbs = f.get(f"{t}.global_batch_size", int, local * dp, ir="train.global_batch_size")
    if gbs % (local * dp):
        raise f.error(f"{t}.global_batch_size", f"{gbs} is not a multiple of local_batch_size * data-parallel ranks "
                                                f"= {local}*{dp}")
    seq = f.get("model.seq_length", int, 4096, ir="train.seq_len")
    train: dict = {"micro_batch_size": local, "global_batch_size": gbs, "seq_len": seq,
                   "steps": f.get(f"{t}.steps", int, 1000, ir="train.steps"),
                   "seed": f.get(f"{t}.seed", int, 42, ir="train.seed")}
    train["data"], _ = read_data(f, "train_dataset.dataloader", seq, warnings)
    kind = f.get("optimizer.type", str, "AdamW", ir="train.optimizer.name")
    if kind not in OPTIMIZERS:
        warnings.append(f"optimizer.type = {kind}: read as AdamW")
    betas = f.get("optimizer.betas", list, [0.9, 0.999], ir="train.optimizer.beta1")
    opt = {"name": "adamw", "beta1": float(betas[0]), "beta2": float(betas[1]),
           "eps": f.get("optimizer.eps", float, 1e-8, ir="train.optimizer.eps"),
           "weight_decay": f.get("optimizer.weight_decay", float, 0.0, ir="train.optimizer.weight_decay"),
           "weight_decay_1d": _decays_1d(f, warnings),
           "grad_clip": f.get(f"{t}.max_norm", float, 1.0, ir="train.optimizer.grad_clip")}
    train["schedule"], _, opt["lr"] = read_schedule(f, "lr_scheduler", None, train["steps"], warnings)
    train["optimizer"] = opt
    ck = "checkpoint"
    on = f.get(f"{ck}.enable_save", bool, True, ir="train.checkpoint.interval")
    train["checkpoint"] = {"interval": f.get(f"{ck}.save_interleaved_steps", int, 1000) if on else 0,
                           "keep_last": f.get(f"{ck}.save_max", int, 5, ir="train.checkpoint.keep_last"),
                           "async_save": f.get(f"{ck}.async_save", bool, False, ir="train.checkpoint.async_save"),
                           "load": f.get(f"{ck}.load_path", str, "", ir="train.checkpoint.load")}
    return train
