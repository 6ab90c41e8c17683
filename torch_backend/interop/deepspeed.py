"""DeepSpeed ZeRO checkpoints <-> ms_llm (`ms-llm import-run` / `export-run --to deepspeed`).

A DeepSpeed save (deepspeed_files.py describes its files) holds, per dp rank, a flat partition of the
fp32 master weights and of Adam's moments, and the module's weights in the training dtype (ZeRO-1/2).
read_run gives them under ms_llm's names: the names are those of the module DeepSpeed wrapped,
Hugging Face's for transformers' models, which are ms_llm's. The weights are the fp32 masters (a
bf16 / fp16 run: the module's weights, the masters as optim.master.<name>); the training state is
global_steps, Adam's step count, the next step's lr and (fp16) the loss scale.

The save holds no head count: the model comes from config.json, the model's Hugging Face config that
transformers' Trainer saves beside `latest` (in the folder named, --config itself, or beside
--config; nothing above the folder named is read). --config ds_config.json (else the ds_config
DeepSpeed recorded in the save) becomes the job. write_run is deepspeed_export.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

import ms_llm.convert as convert
from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
from ms_llm.checkpoint.storage.safetensors_io import storage_dtype
from ms_llm.checkpoint.storage.untrusted import confined, integer, read_regular
from ms_llm.config.hf import model_from_hf_config
from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import ConversionError, ReadOptions
from ms_llm.errors import CheckpointError
from ms_llm.job import job_from_dict, job_to_dict
from ms_llm.run.lr import lr_at
from torch_backend.checkpoint import to_numpy
from torch_backend.interop.deepspeed_files import (HF_CONFIG, MODEL_STATES, MOMENTS, RANK_MODEL_STATES, Found, Place,
                                                   Mapped, _Peer, count, field, load, locate, open_ranks,
                                                   param_shapes)


def detect(folder: Path) -> bool:
    """A DeepSpeed save, by its file names."""
    try:
        return locate(folder) is not None
    except CheckpointError:             # a 'latest' naming something outside: not a save this reads
        return False


# ---- import ---------------------------------------------------------------------------------------

def read_run(folder: Path, config: Optional[Path]) -> ForeignRun:
    """The save in `folder` (a save folder, or the folder whose `latest` names one) as a ForeignRun
    whose tensors are read when written; `config`: ds_config.json or the model's config.json."""
    found = locate(folder)
    if found is None:
        raise CheckpointError(f"{folder}: no DeepSpeed checkpoint here (a 'latest' file naming a folder with "
                              f"{MODEL_STATES} or {RANK_MODEL_STATES.format(0)})")
    tag = found.tag
    states_path = tag / (MODEL_STATES if (tag / MODEL_STATES).is_file() else RANK_MODEL_STATES.format(0))
    mapped = Mapped(states_path, "the model states")
    states = mapped.data
    mp = states.get("mp_world_size", 1)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if mp != 1 or dims.get("tp_degree", 1) != 1 or dims.get("pp_degree", 1) != 1:
        raise CheckpointError(f"{states_path}: saved with tensor or pipeline parallelism (mp_world_size {mp}, {dims}); "
                              "only data-parallel ZeRO checkpoints import: convert it with DeepSpeed's ds_to_universal "
                              "first")
    step = integer(count(states.get("global_steps")), str(states_path), "global_steps")
    skipped = integer(count(states.get("skipped_steps", 0)), str(states_path), "skipped_steps", 0, step)
    shapes = param_shapes(field(states, "param_shapes", states_path), states_path, "param_shapes")
    ds_config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    lp = _lp_dtype(ds_config)
    model, notes = _model(found, config, lp), []
    if states.get("frozen_param_shapes"):
        frozen = ", ".join(list(states["frozen_param_shapes"])[:3])
        raise CheckpointError(f"{states_path}: has frozen parameters ({frozen}); ms_llm trains every weight, so a "
                              "partly frozen run does not import")
    if found.universal:
        tensors, hyper, world = _universal(found, shapes, lp, states_path)
    else:
        tensors, hyper, world = _zero(tag, shapes, lp, mapped)
    state, state_notes = _state(step, skipped, hyper, lp, tag)
    job, job_notes = _job(config, ds_config, model, world, states_path)
    if job is not None and "lr" in state:
        ours = lr_at(step, job_from_dict(job).train)
        if not math.isclose(ours, state["lr"], rel_tol=1e-6, abs_tol=1e-12):
            notes.append(f"learning rate: DeepSpeed's next step would use {state['lr']:.6g}, the job's train.schedule "
                         f"gives {ours:.6g} at step {step} (ms_llm computes it from the schedule)")
    if states.get("data_sampler") is not None:
        notes.append("DeepSpeed's data sampler state is not carried: ms_llm's data order continues from step "
                     f"{step} (set train.data to the run's tokenized data)")
    return ForeignRun("deepspeed", model, step, tensors, state, job, notes + state_notes + job_notes)


def _lp_dtype(ds_config: dict) -> str:
    """The training dtype of the module's weights, from the config DeepSpeed recorded."""
    def enabled(key: str) -> bool:
        section = ds_config.get(key)
        return isinstance(section, dict) and section.get("enabled") is True
    return "bfloat16" if enabled("bf16") or enabled("bfloat16") else "float16" if enabled("fp16") else "float32"


def _model(found: Found, config: Optional[Path], lp: str) -> ModelConfig:
    """The ModelConfig of the Hugging Face config.json beside the checkpoint (or --config itself
    when it is one)."""
    candidates = [found.root / HF_CONFIG, found.tag / HF_CONFIG]        # nothing above the folder named
    if config is not None:
        candidates = ([config] if _is_hf_config(config) else [Path(config).parent / HF_CONFIG]) + candidates
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise CheckpointError(f"{found.root}: no {HF_CONFIG} (the model's Hugging Face config) here or beside "
                              "--config; a DeepSpeed save holds no head count: pass --config path/to/config.json, "
                              f"or save it with model.config.save_pretrained('{found.root}')")
    try:
        cfg = json.loads(read_regular(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a JSON config ({exc})") from None
    return model_from_hf_config(cfg, str(path), lp)


def _is_hf_config(path: Path) -> bool:
    try:
        data = json.loads(read_regular(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, CheckpointError):
        return False
    return isinstance(data, dict) and "model_type" in data


def _zero(tag: Path, shapes, lp: str, states: Mapped):
    """The tensors of a ZeRO-1/2/3 save: fp32 masters and moments out of the ranks' partitions."""
    ranks = open_ranks(tag, states.data, states.path)
    tensors: dict[str, LazyTensor] = {}
    for place, pieces in ranks.places(shapes, states.path):
        def reader(kind: str, place: Place = place, pieces=pieces) -> Callable[[], np.ndarray]:
            return lambda: ranks.read(kind, pieces, place.numel).reshape(place.shape)
        master = LazyTensor(place.shape, "float32", reader("fp32"))
        if lp == "float32":
            tensors[place.name] = master
        else:
            tensors[optim_name("master", place.name)] = master
            tensors[place.name] = _lp_weight(place, lp, master, states if ranks.stage != 3 else None)
        for kind in MOMENTS:
            tensors[optim_name(kind, place.name)] = LazyTensor(place.shape, "float32", reader(kind))
    return tensors, ranks.meta[0], ranks.world


def _lp_weight(place: Place, lp: str, master: LazyTensor, states: Optional[Mapped]) -> LazyTensor:
    """The module's 16-bit weight: ZeRO-1/2 save it whole in the model states; ZeRO-3 keeps it as
    the master weights' copy in the training dtype (what its partitions are refreshed to)."""
    def read() -> np.ndarray:
        if states is None:
            return to_numpy(torch.from_numpy(master.read()).to(_TORCH[lp]))
        def weight(data: Any) -> torch.Tensor:
            value = field(data, "module", states.path, dict).get(place.name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != place.shape:
                raise CheckpointError(f"{states.path}: module weight {place.name!r} is missing or not of shape "
                                      f"{list(place.shape)}")
            return value
        out = np.empty(place.numel, storage_dtype(lp))
        states.copy(weight, 0, out)
        return out.reshape(place.shape)
    return LazyTensor(place.shape, lp, read)


_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _universal(found: Found, shapes, lp: str, states_path: Path):
    """The tensors of a ds_to_universal folder: zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt, whole."""
    zero = found.tag / "zero"
    tensors: dict[str, LazyTensor] = {}
    for group in shapes:
        for name, shape in group:
            folder = confined(zero, name, f"the folder of parameter {name!r}")

            def reader(kind: str, folder: Path = folder, shape=shape) -> Callable[[], np.ndarray]:
                def read() -> np.ndarray:
                    path = folder / f"{kind}.pt"

                    def param(data: Any) -> torch.Tensor:
                        if isinstance(data, dict):      # ZeRO-1/2's {'param': ..., 'cat_dim': ...}, ZeRO-3's bare
                            data = field(data, "param", path, torch.Tensor)      # tensor, flat
                        if data.numel() != math.prod(shape) or data.dim() not in (1, len(shape)):
                            raise CheckpointError(f"{path}: 'param' has shape {list(data.shape)}, param_shapes says "
                                                  f"{list(shape)}; merged from tensor-parallel slices?")
                        return data
                    out = np.empty(math.prod(shape), np.float32)
                    Mapped(path, f"the universal checkpoint's {kind} of {folder.name}", (dict, torch.Tensor)).copy(
                        param, 0, out)
                    return out.reshape(shape)
                return read
            master = LazyTensor(shape, "float32", reader("fp32"))
            if lp == "float32":
                tensors[name] = master
            else:
                tensors[optim_name("master", name)] = master
                tensors[name] = _lp_weight(Place(name, shape, 0, 0), lp, master, None)
            for kind in MOMENTS:
                tensors[optim_name(kind, name)] = LazyTensor(shape, "float32", reader(kind))
    common = zero / "optimizer_state.pt"
    meta = load(common, "the universal checkpoint's common optimizer state")
    hyper = {"loss_scaler": meta.get("loss_scaler"), "groups": [
        {k: v for k, v in g.items() if k != "params"} for g in meta.get("param_groups") or [] if isinstance(g, dict)]}
    name = shapes[0][0][0] if shapes and shapes[0] else None
    if name is not None and (confined(zero, name, "a parameter folder") / "step.pt").is_file():
        path = confined(zero, name, "a parameter folder") / "step.pt"
        hyper["step"] = count(load(path, "Adam's step count", (torch.Tensor, int, float)))
    world = count(load(states_path, "the model states").get("dp_world_size", 1))
    return tensors, hyper, world if isinstance(world, int) and world > 0 else 1


def _state(step: int, skipped: int, hyper: dict, lp: str, where: Path) -> tuple[dict, list[str]]:
    """ms_llm's training state from DeepSpeed's: Adam's step count, the next step's lr, the loss scale."""
    notes = []
    optimizer_step = hyper.get("step", step - skipped)
    optimizer_step = integer(optimizer_step if isinstance(optimizer_step, int) else None, str(where),
                             "the optimizer's step count", 0, step)
    state: dict[str, Any] = {"optimizer_step": optimizer_step}
    groups = hyper.get("groups") or []
    if groups:
        lrs = {g.get("lr") for g in groups}
        lr = groups[0].get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr):
            state["lr"] = float(lr)
        if len(lrs) > 1:
            notes.append(f"learning rate: DeepSpeed's parameter groups use {sorted(lrs)}; ms_llm has one (the first's)")
        decays = sorted({g.get("weight_decay") for g in groups}, key=str)
        if len(decays) > 1:
            notes.append(f"weight decay: DeepSpeed's parameter groups use {decays}; ms_llm applies "
                         "train.optimizer.weight_decay to every weight")
    scaler = hyper.get("loss_scaler")
    if lp == "float16" and isinstance(scaler, _Peer):
        attrs = vars(scaler)
        scale = float(attrs.get("cur_scale", 1.0))
        if attrs.get("dynamic"):
            window = attrs.get("scale_window", 1000)
            good = max(0, attrs.get("cur_iter", step) - attrs.get("last_overflow_iter", -1) - 1) % max(1, window)
            state["loss_scale"] = {"mode": "dynamic", "scale": scale, "good_steps": min(good, step, 999),
                                   "skipped": step - optimizer_step}
            if window != 1000 or attrs.get("delayed_shift", 1) != 1:
                notes.append(f"loss scale: DeepSpeed's loss_scale_window {window} and hysteresis "
                             f"{attrs.get('delayed_shift')}; ms_llm doubles after 1000 finite steps and halves on "
                             "every overflow")
        else:
            state["loss_scale"] = {"mode": "static", "scale": scale, "good_steps": 0, "skipped": step - optimizer_step}
    return state, notes


def _job(config: Optional[Path], recorded: dict, model: ModelConfig, world: int,
         states_path: Path) -> tuple[Optional[dict], list[str]]:
    """The ms_llm job of --config's ds_config.json, else of the ds_config DeepSpeed recorded."""
    options = ReadOptions(model=model, world_size=world)
    if config is not None and not _is_hf_config(config):
        conv = convert.load(config, "deepspeed", options)
        return job_to_dict(conv.job), list(conv.warnings)
    if not recorded:
        return None, []
    try:
        conv = convert.read(json.dumps(recorded), f"{states_path}:ds_config", "deepspeed", options)
    except ConversionError as exc:
        return None, [f"the ds_config recorded in the checkpoint does not convert ({exc}); pass --config"]
    return job_to_dict(conv.job), [f"job from the ds_config recorded in {states_path.name}"] + list(conv.warnings)


# ---- export ---------------------------------------------------------------------------------------

def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    from torch_backend.interop.deepspeed_export import write_run as write
    return write(ckpt, Path(out), job)

