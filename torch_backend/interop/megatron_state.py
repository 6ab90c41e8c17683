"""What a Megatron-LM checkpoint holds besides tensors, both ways: its arguments as an ms_llm job (through
ms_llm.convert's Megatron-LM reader, or --config), its training state (iteration, the param groups'
optimizer step, the OptimizerParamScheduler's next learning rate, the grad scaler, consumed samples) as
an ms_llm checkpoint head's, and the common.pt an export needs for Megatron-LM's load_checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shlex
from pathlib import Path
from typing import Any, Optional

import torch

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.convert import ConversionError, ReadOptions, load as load_config, read as read_config
from ms_llm.convert.megatron.read import parse_args
from ms_llm.convert.megatron.write import write as write_script
from ms_llm.convert.shell import launch_command
from ms_llm.errors import CheckpointError
from ms_llm.job import JobConfig, job_from_dict, job_to_dict
from ms_llm.run.loss_scale import GROWTH_INTERVAL
from ms_llm.run.lr import lr_at
from torch_backend.checkpoint import TORCH_DTYPES
from torch_backend.interop.megatron_files import PeerValue

HYSTERESIS = 2          # Megatron-LM's --hysteresis default: overflowing steps before the scale drops
# The distributed optimizer's state as the export writes it: model space, loadable under any tp, pp, dp.
EXPORT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                   "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                   "chained_optim_avoid_prefix": True}
# Megatron-LM's argparse defaults of the arguments its load_args_from_checkpoint (--use-checkpoint-args) and
# ms_llm's reader take from a checkpoint: its saved Namespace holds every argument, given or not.
MEGATRON_DEFAULTS = {"group_query_attention": False, "num_query_groups": 1, "swiglu": False,
                     "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "rotary_base": 10000,
                     "rotary_percent": 1.0, "rotary_interleaved": False, "use_rotary_position_embeddings": False,
                     "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
                     "untie_embeddings_and_output_weights": False, "apply_layernorm_1p": False,
                     "make_vocab_size_divisible_by": 128, "attention_dropout": 0.1, "hidden_dropout": 0.1,
                     "bf16": False, "fp16": False, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                     "context_parallel_size": 1, "sequence_parallel": False, "use_distributed_optimizer": False}
ATTN_BACKENDS = {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"}    # megatron-core's AttnBackend


def args_text(args: argparse.Namespace) -> str:
    """Megatron-LM's saved arguments as the command-line flags its argparse read them from."""
    words = []
    values = vars(args)
    for key, value in sorted(values.items()):
        flag = "--" + key.replace("_", "-")
        if key == "add_bias_linear":
            words += ["--disable-bias-linear"] if value is False else []
        elif key == "vocab_size" and value is None and values.get("padded_vocab_size"):
            words += [flag, str(values["padded_vocab_size"])]
        elif key == "attention_backend" and isinstance(value, PeerValue) and ATTN_BACKENDS.get(value.value) \
                not in (None, "auto"):           # the enum Megatron-LM stores; auto is its default
            words += [flag, ATTN_BACKENDS[value.value]]
        elif value is True:
            words.append(flag)
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            words += [flag, str(value)]
        elif (isinstance(value, list) and value
              and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value)):
            words += [flag, *map(str, value)]
    return " ".join(shlex.quote(w) for w in words)


def job_and_model(config: Optional[Path], args, where: Path) -> tuple[dict, ModelConfig, list[str]]:
    """The job converted from --config, else from the checkpoint's own arguments."""
    if config is not None:
        conv = load_config(config, "megatron")
        return job_to_dict(conv.job), conv.job.model, list(conv.warnings)
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{where}: holds no Megatron-LM arguments ('args'); pass --config with the run's "
                              "train script or arguments")
    world = getattr(args, "world_size", None)
    run = where.parent if where.name.startswith("iter_") else where
    conv = read_config(args_text(args), f"{run}.sh", "megatron",
                       ReadOptions(world_size=world if isinstance(world, int) and world > 0 else None))
    dropped = [w for w in conv.warnings if w.endswith("not modelled by ms_llm; dropped")]
    notes = [w for w in conv.warnings if w not in dropped]
    if dropped:
        notes.append(f"job from the checkpoint's saved arguments; {len(dropped)} of them have no ms_llm setting")
    return job_to_dict(conv.job), conv.job.model, notes


def megatron_lr(s: dict) -> Optional[float]:
    """OptimizerParamScheduler.get_lr of a saved scheduler (the next iteration's rate; warmup from
    Megatron-LM's default --lr-warmup-init 0, which the state does not hold); None for other styles."""
    n, warm, decay = s["num_steps"], s["lr_warmup_steps"], s["lr_decay_steps"]
    top, low, style = s["max_lr"], s["min_lr"], s["lr_decay_style"]
    if warm > 0 and n <= warm:
        return top * n / warm
    if style == "constant":
        return top
    if n > decay:
        return low
    if style == "inverse-square-root":
        return max(low, top * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = (n - warm) / (decay - warm)
    coeff = {"linear": 1.0 - ratio, "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0)}.get(style)
    return None if coeff is None else low + coeff * (top - low)


def training_state(source, args, model: ModelConfig, job: dict, step: int) -> tuple[dict, list[str]]:
    """The head's training state (ms_llm/run/saved_state.py) from a checkpoint `source` (its common state,
    param groups and moments), and notes on what continues differently in ms_llm."""
    state: dict[str, Any] = {}
    notes: list[str] = []
    inner = source.optimizer.get("optimizer", source.optimizer)
    common_step = inner.get("state", {}).get("common_step") if isinstance(inner.get("state"), dict) else None
    steps = ({g.get("step") for g in source.groups if g.get("step") is not None} or {common_step} - {None}
             or source.param_steps)          # torch's own state_dict keeps the step per parameter
    if source.has_moment("exp_avg") and len(steps) == 1:
        state["optimizer_step"] = int(next(iter(steps)))
    elif not source.has_moment("exp_avg"):
        state["optimizer_step"] = 0
    scheduler = source.common.get("opt_param_scheduler")
    train = job_from_dict(job, None, "imported job: ").train
    if any(g.get("wd_mult", 1.0) != 1.0 for g in source.groups) and train.optimizer.weight_decay_1d:
        notes.append("Megatron-LM exempted norms and biases from weight decay (wd_mult 0); the job decays them "
                     "(train.optimizer.weight_decay_1d: true): set it false to continue as Megatron-LM did")
    if isinstance(scheduler, dict):
        try:
            lr = megatron_lr(scheduler)
        except (KeyError, TypeError, ZeroDivisionError):
            lr = None
        if lr is not None:
            state["lr"] = float(lr)
            ours = lr_at(step, train)
            if not math.isclose(ours, lr, rel_tol=1e-6, abs_tol=1e-12):
                notes.append(f"learning rate at step {step}: Megatron-LM's schedule gives {lr:.6g}, the job's "
                             f"{ours:.6g}, which the continuation follows (in warmup ms_llm's reaches lr*(s+1)/w at "
                             "step s, Megatron-LM's lr*s/w)")
    scaler = source.optimizer.get("grad_scaler") if isinstance(source.optimizer, dict) else None
    if isinstance(scaler, dict) and "scale" in scaler and "optimizer_step" in state:
        state["loss_scale"] = {"mode": "dynamic", "scale": float(scaler["scale"]),
                               "good_steps": min(int(scaler.get("growth_tracker", 0)), GROWTH_INTERVAL - 1),
                               "skipped": step - state["optimizer_step"]}
    consumed = getattr(args, "consumed_train_samples", None)
    if isinstance(consumed, int) and not isinstance(consumed, bool) and consumed >= 0:
        # The position in the sample order of the job's data (seed and global batch from the same arguments).
        state["sampler"] = {"seed": train.seed, "epoch": 0, "position": consumed, "index": ""}
    return state, notes


def _typed(value: Any) -> Any:
    """A flag's text as Megatron-LM's argparse types it: int, else float, else the string."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, bool):                 # a store_true flag
        return value
    for kind in (int, float):
        with contextlib.suppress(TypeError, ValueError):
            return kind(value)
    return value


def export_job(job: Optional[dict], model: ModelConfig, saved: dict, step: int) -> JobConfig:
    """The job an export's arguments are written from: --job's, else the checkpoint's model on one rank in
    its own dtype at the checkpoint's learning rate held constant (the scheduler common_state then writes),
    1-D parameters not decayed as in Megatron-LM, ms_llm's defaults otherwise."""
    if job:
        return job_from_dict(job, None, "--job: ")
    precision = {"param_dtype": model.dtype, "compute_dtype": model.dtype}
    if model.dtype == "float16":
        precision["loss_scale"] = "dynamic"
    lr = float(saved.get("lr", lr_at(step, TrainConfig())))
    train = {"seq_len": min(TrainConfig().seq_len, model.max_seq_len), "schedule": {"decay": "constant"},
             "optimizer": {"lr": lr, "weight_decay_1d": False}}
    return job_from_dict({"name": "export", "model": to_dict(model, full=True), "train": train,
                          "strategy": {"dp": 1, "precision": precision}}, None, "export: ")


def saved_args(job: JobConfig, model: ModelConfig, out: Path) -> argparse.Namespace:
    """The Namespace Megatron-LM's parse_args holds for the launch script `ms-llm convert-strategy --to
    megatron` writes for `job` (with the checkpoint's model): argparse's names and defaults, the sizes
    validate_args derives, --save the export folder (no --load: ms_llm's folders are not Megatron's).
    args_text reads it back to the same model and settings. Megatron-LM stores --attention-backend as
    megatron-core's AttnBackend, which cannot be pickled without megatron: it is stored by name."""
    job = dataclasses.replace(job, model=model)
    s = job.strategy
    world = max(s.dp, 1) * s.tp * s.pp * s.cp         # dp -1 (the world's rest) is written as 1
    try:
        text = write_script(job, world).text
        flags = parse_args(launch_command(text, "export.sh").args, "export.sh")
    except ConversionError as exc:
        raise CheckpointError(f"export --to megatron: the job's Megatron-LM arguments: {exc}") from None
    args: dict[str, Any] = dict(MEGATRON_DEFAULTS)
    for flag, value in flags.items():
        if flag == "--disable-bias-linear":
            args["add_bias_linear"] = False
        else:
            args[flag[2:].replace("-", "_")] = _typed(value)
    args.update(save=str(Path(out).resolve()), load=None, padded_vocab_size=model.vocab_size,
                kv_channels=model.head_dim, add_position_embedding=False, params_dtype=TORCH_DTYPES[model.dtype],
                use_dist_ckpt=True, ckpt_format="torch_dist", world_size=world,
                data_parallel_size=world // (s.tp * s.pp * s.cp))
    return argparse.Namespace(**args)


def common_state(model: ModelConfig, step: int, saved: dict, train: Optional[TrainConfig], with_optim: bool,
                 args: argparse.Namespace) -> dict:
    """common.pt of an export: what Megatron-LM's load_checkpoint reads besides the tensors. The scheduler
    counts samples as Megatron-LM's OptimizerParamScheduler does (iterations x global batch); without a
    job it is constant at the checkpoint's learning rate. The param groups carry the keys torch's AdamW,
    Apex's and Transformer Engine's FusedAdam read, and the two groups megatron-core forms by default
    (weight decay on, and off for norms and biases), matched by wd_mult / lr_mult on load."""
    t = train or TrainConfig()
    gbs, o, sch = t.global_batch_size, t.optimizer, t.schedule
    lr = float(saved.get("lr", lr_at(step, t)))
    if train is not None:
        scheduler = {"max_lr": o.lr, "min_lr": o.lr * sch.min_lr_ratio, "lr_warmup_steps": sch.warmup_steps * gbs,
                     "lr_decay_steps": t.steps * gbs, "lr_decay_style": sch.decay}
    else:
        scheduler = {"max_lr": lr, "min_lr": lr, "lr_warmup_steps": 0, "lr_decay_steps": max(step, 1) * gbs,
                     "lr_decay_style": "constant"}
    scheduler.update(num_steps=step * gbs, start_wd=o.weight_decay, end_wd=o.weight_decay,
                     wd_incr_steps=t.steps * gbs, wd_incr_style="constant")
    args = argparse.Namespace(**{**vars(args), "iteration": step, "consumed_train_samples": step * gbs,
                                 "consumed_valid_samples": 0, "global_batch_size": gbs})
    common: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": step,
                              "opt_param_scheduler": scheduler, "num_floating_point_operations_so_far": 0,
                              "content_metadata": dict(EXPORT_METADATA)}
    if not with_optim:
        return common
    adam = {"lr": lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "bias_correction": True, "step": float(saved.get("optimizer_step", step))}
    groups = [{"is_expert_parallel": False, "default_config": True, "wd_mult": mult, "lr_mult": 1.0,
               "is_decoupled_lr": False, "max_lr": scheduler["max_lr"], "min_lr": scheduler["min_lr"],
               **adam, "weight_decay": o.weight_decay * mult} for mult in (1.0, 0.0)]
    common["optimizer"] = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
    scale = saved.get("loss_scale")
    if scale:                                   # megatron-core's DynamicGradScaler.state_dict
        common["optimizer"]["grad_scaler"] = {"scale": torch.tensor([float(scale["scale"])]), "hysteresis_tracker":
                                              HYSTERESIS, "growth_tracker": int(scale["good_steps"])}
    return common
