"""export-run --to deepspeed: an ms_llm checkpoint as a save DeepSpeed's engine.load_checkpoint resumes
from (weights, Adam moments and step, lr scheduler position, loss scale) and zero_to_fp32 reads.

    out/latest                  "global_step<N>"
    out/config.json             the model's Hugging Face config (transformers builds the module DeepSpeed wraps)
    out/ds_config.json          the job's settings as DeepSpeed JSON (ms_llm/convert/deepspeed)
    out/global_step<N>/         the files deepspeed.py lists, for ZeRO stage S over dp ranks

The target is the job's strategy (export-run --job), else the checkpoint's own: ZeRO stage
strategy.zero.stage (stage 0 is written as stage 1: the same weights and moments, DeepSpeed's
sharded layout) over strategy.dp ranks, in strategy.precision.compute_dtype; a DeepSpeed save holds
data-parallel ranks only, so tp, pp, cp and ep must be 1. One parameter group holds every weight, as
deepspeed.initialize(model_parameters=model.parameters()) builds it, in the model's parameter order
(layout_plan's, which is Hugging Face's registration order).

Streaming: each file is first written by torch.save under torch.serialization.skip_data, with
placeholder tensors that are never touched (so never resident): that lays the zip out and reserves
every tensor's bytes. Then each parameter is read once from the ms_llm checkpoint and its pieces are
written in place (os.pwrite) into every rank's files: the peak is one parameter and its cast.
DeepSpeed's loss scaler and fragment records are pickled under DeepSpeed's class names (_PeerPickler),
which DeepSpeed's own torch.load resolves to its classes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import ms_llm.convert as convert
from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.storage.safetensors_io import bf16_to_f32
from ms_llm.config.hf import hf_config
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError, MsLlmError
from ms_llm.job import JobConfig, job_from_dict
from ms_llm.run.lr import lr_at
from ms_llm.strategy.ir import ParallelStrategy
from torch_backend.checkpoint import to_numpy
from torch_backend.interop.deepspeed_files import (HF_CONFIG, LATEST, MODEL_STATES, MOMENTS, OPTIM_STATES,
                                                   RANK_MODEL_STATES, DynamicLossScaler, FragmentAddress, LossScaler,
                                                   _Peer)

DS_VERSION = "0.19.8"                        # the DeepSpeed release whose layout this writes
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SUB_GROUP_SIZE = 10 ** 9                     # zero_optimization.sub_group_size's default (ZeRO-3)
TIED = ("model.embed_tokens.weight", "lm_head.weight")     # a tied head: one parameter, both names in the module


class _PeerPickler(pickle._Pickler):
    """The pure-Python pickler, writing a _Peer class as the DeepSpeed class it names (GLOBAL
    module / name) without looking that name up here."""

    def save_global(self, obj: Any, name: Optional[str] = None) -> None:
        if isinstance(obj, type) and issubclass(obj, _Peer) and obj.PEER:
            module, _, qualname = obj.PEER.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


PICKLE = types.ModuleType("deepspeed_pickle")     # what torch.save takes as its pickle module
PICKLE.Pickler = _PeerPickler


def _peer(cls: type, **attrs: Any) -> _Peer:
    obj = cls()
    obj.__dict__.update(attrs)
    return obj


@dataclass
class _File:
    """One file being written: its object with placeholders, and each placeholder's fill."""
    path: Path
    obj: dict
    rank: Optional[int] = None                  # the dp rank of an optimizer-states file
    fills: dict[int, tuple[torch.Tensor, str, int]] = field(default_factory=dict)   # storage -> (tensor, what, at)
    offsets: dict[int, int] = field(default_factory=dict)                           # storage -> byte offset

    def placeholder(self, numel: int, dtype: torch.dtype, what: str = "", at: int = 0) -> torch.Tensor:
        """An untouched tensor of `numel` elements whose bytes are written later: `what` names the
        tensor kind ("fp32", "exp_avg", ..., a weight's name) and `at` its first flat element there."""
        t = torch.empty(numel, dtype=dtype)
        self.fills[_storage(t)] = (t, what, at)
        return t

    def save(self) -> None:
        """Write the zip with every tensor's bytes reserved, and find where each one lies."""
        with torch.serialization.skip_data():
            torch.save(self.obj, self.path, pickle_module=PICKLE)
        order: dict[int, torch.Tensor] = {}
        _walk(self.obj, order)
        with zipfile.ZipFile(self.path) as z, open(self.path, "rb") as f:
            records = {info.filename.split("/", 1)[1]: info for info in z.infolist()}
            for key, (storage, t) in enumerate(order.items()):
                info = records.get(f"data/{key}")
                if info is None or info.file_size != t.untyped_storage().nbytes():
                    raise CheckpointError(f"{self.path}: torch.save laid record data/{key} out unlike expected")
                f.seek(info.header_offset)
                header = f.read(30)             # a zip local header: name and extra-field lengths at 26 and 28
                self.offsets[storage] = (info.header_offset + 30 + int.from_bytes(header[26:28], "little")
                                         + int.from_bytes(header[28:30], "little"))


def _storage(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (a view shares its base's)."""
    return t.untyped_storage()._cdata


def _walk(obj: Any, order: dict[int, torch.Tensor]) -> None:
    """The tensors of `obj` in the order pickle meets their storages (torch.save numbers them so)."""
    if isinstance(obj, torch.Tensor):
        order.setdefault(_storage(obj), obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(key, order)
            _walk(value, order)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, order)
    elif isinstance(obj, _Peer):
        _walk(vars(obj), order)


@dataclass(frozen=True)
class Target:
    """What DeepSpeed resumes with: ZeRO `stage` over `dp` ranks in `dtype`, its config and the job."""
    job: JobConfig
    stage: int
    dp: int
    dtype: str
    ds_config: dict


def target_of(ckpt: Checkpoint, job: Optional[dict]) -> Target:
    model = ckpt.model_config()
    if job is None:                     # the checkpoint's own degrees, ZeRO stage and precision
        s = ckpt.strategy()
        dp = s.dp if s.dp > 0 else 1
        strategy = {**{k: getattr(s, k) for k in ("tp", "pp", "cp", "ep")}, "dp": dp,
                    "zero": {"stage": s.zero.stage}, "precision": to_dict(s.precision, full=True)}
        job = {"name": "deepspeed_export", "model": to_dict(model, full=True), "strategy": strategy,
               "train": {"global_batch_size": dp, "micro_batch_size": 1}}
    try:
        jc = job_from_dict(job, None, "export-run --job: ")
    except MsLlmError as exc:
        raise CheckpointError(str(exc)) from None
    s = jc.strategy
    wide = {k: getattr(s, k) for k in ("tp", "pp", "cp", "ep") if getattr(s, k) != 1}
    if wide:
        raise CheckpointError(f"export-run --to deepspeed: the job's strategy has {wide}; a DeepSpeed ZeRO save holds "
                              "data-parallel ranks only: pass --job with tp, pp, cp and ep 1 (e.g. strategy.dp 2, "
                              "strategy.zero.stage 3)")
    want = {n: p.shape for n, p in layout_plan(model, ParallelStrategy(dp=1), 1).params.items()}
    have = {n: p.shape for n, p in layout_plan(jc.model, ParallelStrategy(dp=1), 1).params.items()}
    if want != have:
        raise CheckpointError(f"export-run --job: its model is not the checkpoint's ({model.name}); export with the "
                              "job the checkpoint was trained with")
    stage = s.zero.stage or 1
    dp = s.dp if s.dp > 0 else 1
    jc = dataclasses.replace(jc, model=model, strategy=dataclasses.replace(
        s, dp=dp, zero=dataclasses.replace(s.zero, stage=stage)))
    text = convert.dump(convert.from_job(jc, dp), "deepspeed").text
    return Target(jc, stage, dp, s.precision.compute_dtype, json.loads(text))


def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    target = target_of(ckpt, job)
    model, step = ckpt.model_config(), ckpt.step
    params = {n: tuple(p.shape) for n, p in layout_plan(model, ParallelStrategy(dp=1), 1).params.items()}
    tag = out / f"global_step{step}"
    tag.mkdir(parents=True, exist_ok=True)
    has_moments = all(optim_name(k, n) in ckpt.index.tensors for n in params for k in MOMENTS)
    state = ckpt.state
    optimizer_step = int(state.get("optimizer_step", step)) if has_moments else 0
    layout = Zero3(params, target) if target.stage == 3 else Zero12(params, target)
    header = _header(target, step, optimizer_step)
    files = layout.files(tag, header, _optimizer(target, step, optimizer_step, state, len(layout.groups)))
    for f in files:
        f.save()
    fds = {f.path: os.open(f.path, os.O_RDWR) for f in files}
    try:
        for name in params:                 # one tensor in memory at a time (and the master's cast)
            master = _master(ckpt, name)
            lp = _lp(ckpt, name, master, target.dtype)
            for f in files:
                layout.fill(f, fds[f.path], name, "fp32", master, lp)
            del master, lp
            for kind in MOMENTS:
                moment = (ckpt.read_full(optim_name(kind, name)).astype(np.float32, copy=False).reshape(-1)
                          if has_moments else np.zeros(math.prod(params[name]), np.float32))
                for f in files:
                    layout.fill(f, fds[f.path], name, kind, moment, None)
                del moment
    finally:
        for fd in fds.values():
            os.close(fd)
    (out / HF_CONFIG).write_text(json.dumps(hf_config(model, target.dtype), indent=2))
    (out / "ds_config.json").write_text(json.dumps(target.ds_config, indent=2) + "\n")
    (out / LATEST).write_text(tag.name)
    return out


def _lp(ckpt: Checkpoint, name: str, master: np.ndarray, dtype: str) -> np.ndarray:
    """The module's weight in the training dtype, flat (bfloat16 as its bits): the checkpoint's own
    where it has that dtype, else the master rounded (what DeepSpeed copies into its 16-bit weights)."""
    if dtype == "float32":
        return master
    if ckpt.entry(name).dtype == dtype:
        return ckpt.read_full(name).reshape(-1)
    return to_numpy(torch.from_numpy(master).to(TORCH[dtype])).reshape(-1)


def _master(ckpt: Checkpoint, name: str) -> np.ndarray:
    """The fp32 master weight, flat: optim.master.<name> where the checkpoint keeps one, else the weight."""
    key = optim_name("master", name) if optim_name("master", name) in ckpt.index.tensors else name
    array = ckpt.read_full(key)
    if ckpt.entry(key).dtype == "bfloat16":
        array = bf16_to_f32(array)
    return array.astype(np.float32, copy=False).reshape(-1)


def _header(target: Target, step: int, optimizer_step: int) -> dict:
    """What every model-states file holds besides the module (a tied head is the embedding's)."""
    shared = {TIED[1]: TIED[0]} if target.job.model.tie_embeddings else {}
    return {"buffer_names": [], "optimizer": None, "frozen_param_shapes": OrderedDict(), "shared_params": shared,
            "frozen_param_fragments": OrderedDict(), "lr_scheduler": {"last_batch_iteration": step - 1},
            "data_sampler": None, "random_ltd": None, "skipped_steps": step - optimizer_step, "global_steps": step,
            "global_samples": step * target.job.train.global_batch_size, "dp_world_size": target.dp,
            "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": target.ds_config, "ds_version": DS_VERSION}


def _optimizer(target: Target, step: int, optimizer_step: int, state: dict, groups: int) -> dict:
    """The loss scaler and torch AdamW's hyper-parameters (what DeepSpeed's AdamW, torch's or its
    FusedAdam, reads back), the lr of the next step from the job's schedule."""
    o = target.job.train.optimizer
    group = {"lr": lr_at(step, target.job.train), "betas": (o.beta1, o.beta2), "eps": o.eps,
             "weight_decay": o.weight_decay, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
             "bias_correction": True, "step": optimizer_step, "params": list(range(groups))}
    scale = state.get("loss_scale") or {}
    fp16 = target.ds_config.get("fp16") or {}
    if target.dtype == "float16" and fp16.get("loss_scale", 0) == 0:
        initial = 2.0 ** fp16.get("initial_scale_power", 16)
        hysteresis = int(fp16.get("hysteresis", 2))
        # DeepSpeed's DynamicLossScaler attributes; it doubles after scale_window steps since the last overflow
        scaler = _peer(DynamicLossScaler, cur_scale=float(scale.get("scale", initial)), dynamic=True, cur_iter=step,
                       last_overflow_iter=step - int(scale.get("good_steps", 0)) - 1, scale_factor=2.0,
                       scale_window=int(fp16.get("loss_scale_window", 1000)),
                       min_scale=float(fp16.get("min_loss_scale", 1)), delayed_shift=hysteresis,
                       cur_hysteresis=hysteresis,
                       consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
                       raise_error_at_min_scale=True, dtype=torch.float16)
    else:
        static = float(fp16.get("loss_scale", 1.0)) if target.dtype == "float16" else 1.0
        scaler = _peer(LossScaler, cur_scale=static, dynamic=False)
    return {"loss_scaler": scaler, "dynamic_loss_scale": bool(scaler.dynamic), "overflow": False,
            "clip_grad": float(target.job.train.optimizer.grad_clip), "group": group}


def _state_of(group: dict, moments: list[dict]) -> dict:
    """torch AdamW's state_dict over the flat partitions, one per group."""
    return {"state": {g: {"step": group["step"], **m} for g, m in enumerate(moments)},
            "param_groups": [group]}


class Zero12:
    """ZeRO-1/2: the weights flat in order, padded to a multiple of 2 x dp (DeepSpeed's
    nccl_start_alignment_factor x dp) and cut into dp equal partitions; a rank's saved fp32
    partition leaves out the padding, its moments keep it."""

    def __init__(self, params: dict[str, tuple[int, ...]], target: Target):
        self.params, self.target, self.groups = params, target, [list(params)]
        self.offsets, total = {}, 0
        for name, shape in params.items():
            self.offsets[name] = total
            total += math.prod(shape)
        align = 2 * target.dp
        self.total, self.size = total, -(-total // align) * align // target.dp

    def padding(self, rank: int) -> int:
        lo, hi = rank * self.size, (rank + 1) * self.size
        return self.size if self.total <= lo else hi - self.total if self.total < hi else 0

    def files(self, tag: Path, header: dict, opt: dict) -> list[_File]:
        lp = TORCH[self.target.dtype]
        states = _File(tag / MODEL_STATES, {})
        module = OrderedDict((n, states.placeholder(math.prod(s), lp, n).view(s)) for n, s in self.params.items())
        if self.target.job.model.tie_embeddings:
            module[TIED[1]] = module[TIED[0]]
        states.obj = {"module": module, **header,
                      "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in self.params.items())]}
        files = [states]
        prefix = "bf16_" if self.target.dtype == "bfloat16" else ""
        for rank in range(self.target.dp):
            f = _File(tag / OPTIM_STATES.format(prefix, rank), {})
            lo = rank * self.size
            fp32 = f.placeholder(self.size - self.padding(rank), torch.float32, "fp32", lo)
            moments = {k: f.placeholder(self.size, torch.float32, k, lo) for k in MOMENTS}
            mappings = OrderedDict()
            for name, shape in self.params.items():
                a, b = max(lo, self.offsets[name]), min(lo + self.size, self.offsets[name] + math.prod(shape))
                if a < b:
                    mappings[name] = _peer(FragmentAddress, numel=b - a, start=a - lo)
            f.obj = {"optimizer_state_dict": {
                "loss_scaler": opt["loss_scaler"], "dynamic_loss_scale": opt["dynamic_loss_scale"],
                "overflow": False, "clip_grad": opt["clip_grad"],
                "base_optimizer_state": _state_of(opt["group"], [moments]),
                "single_partition_of_fp32_groups": [fp32], "zero_stage": self.target.stage,
                "group_paddings": [self.padding(rank)], "param_alignment_paddings": [[0] * len(self.params)],
                "partition_count": [self.target.dp], "ds_version": DS_VERSION, "param_slice_mappings": [mappings]},
                "ds_config": self.target.ds_config, "ds_version": DS_VERSION}
            files.append(f)
        return files

    def fill(self, f: _File, fd: int, name: str, kind: str, array: np.ndarray, lp: Optional[np.ndarray]) -> None:
        """Write weight `name`'s `kind` (fp32 master or a moment; `lp`: the module's weight) where `f` holds it."""
        lo, hi = self.offsets[name], self.offsets[name] + array.size
        for key, (t, what, at) in f.fills.items():
            if what == name and lp is not None:
                _pwrite(fd, f.offsets[key], lp)
            elif what == kind:
                a, b = max(lo, at), min(hi, at + t.numel())
                if a < b:
                    _pwrite(fd, f.offsets[key] + (a - at) * 4, array[a - lo:b - lo])


class Zero3:
    """ZeRO-3: every weight cut into dp pieces of ceil(numel / dp) elements (the last zero-padded);
    rank r's flat sub-group concatenates its pieces; weights start a new sub-group past
    sub_group_size elements (DeepSpeed's _create_fp16_sub_groups)."""

    def __init__(self, params: dict[str, tuple[int, ...]], target: Target):
        self.params, self.target = params, target
        self.each = {n: -(-math.prod(s) // target.dp) for n, s in params.items()}
        limit = int((target.ds_config.get("zero_optimization") or {}).get("sub_group_size", SUB_GROUP_SIZE))
        self.groups: list[list[str]] = [[]]
        total = sum(self.each.values())
        size = 0
        for name in params:
            self.groups[-1].append(name)
            size += self.each[name]
            if limit < total and size >= limit and name != list(params)[-1]:
                self.groups.append([])
                size = 0
        self.where = {}                      # name -> (group, offset in the group's flat)
        for g, names in enumerate(self.groups):
            offset = 0
            for name in names:
                self.where[name] = (g, offset)
                offset += self.each[name]

    def files(self, tag: Path, header: dict, opt: dict) -> list[_File]:
        lp = TORCH[self.target.dtype]
        prefix = "bf16_" if self.target.dtype == "bfloat16" else ""
        files = []
        for rank in range(self.target.dp):
            states = _File(tag / RANK_MODEL_STATES.format(rank), {})
            module = OrderedDict((n, torch.empty(0, dtype=lp)) for n in self.params)
            if self.target.job.model.tie_embeddings:
                module[TIED[1]] = module[TIED[0]]
            states.obj = {"module": module, **header,
                          "param_shapes": [OrderedDict((n, torch.Size(self.params[n])) for n in names)
                                           for names in self.groups]}
            f = _File(tag / OPTIM_STATES.format(prefix, rank), {}, rank)
            sizes = [sum(self.each[n] for n in names) for names in self.groups]
            fp32 = [f.placeholder(n, torch.float32, "fp32", g) for g, n in enumerate(sizes)]
            moments = [{k: f.placeholder(n, torch.float32, k, g) for k in MOMENTS} for g, n in enumerate(sizes)]
            f.obj = {"optimizer_state_dict": {
                "zero_stage": 3, "loss_scaler": opt["loss_scaler"], "dynamic_loss_scale": opt["dynamic_loss_scale"],
                "overflow": False, "partition_count": self.target.dp,
                "optimizer_state_dict": _state_of(opt["group"], moments), "fp32_flat_groups": fp32},
                "ds_config": self.target.ds_config, "ds_version": DS_VERSION}
            files += [states, f]
        return files

    def fill(self, f: _File, fd: int, name: str, kind: str, array: np.ndarray, lp: Optional[np.ndarray]) -> None:
        """Write rank f.rank's piece of weight `name`'s `kind` (ZeRO-3 keeps no module weights)."""
        if f.rank is None:
            return
        group, offset = self.where[name]
        each = self.each[name]
        for key, (t, what, g) in f.fills.items():
            if g == group and what == kind:
                piece = np.zeros(each, np.float32)
                part = array[f.rank * each:(f.rank + 1) * each]
                piece[:part.size] = part
                _pwrite(fd, f.offsets[key] + offset * 4, piece)


def _pwrite(fd: int, offset: int, array: np.ndarray) -> None:
    view = memoryview(np.ascontiguousarray(array)).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
