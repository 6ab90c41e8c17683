"""Megatron-LM training checkpoints <-> ms_llm: `ms-llm import-run` reads them (read_run), `ms-llm
export-run --to megatron` writes one Megatron-LM resumes (write_run). Dense GPT/LLaMA models.

Read (a save folder with latest_checkpointed_iteration.txt, or one iter_NNNNNNN folder):
- torch_dist, megatron-core's distributed checkpoint (metadata.json, common.pt, a DCP folder): the
  GPTModel keys (layers stacked on a leading axis), and the Adam state either in model space
  (optimizer.state.<exp_avg|exp_avg_sq|param|fp32_param>.<key>: the plain optimizer, the distributed
  one's fully_reshardable) or in the distributed optimizer's buckets (dp_reshardable, Megatron-LM's
  default; megatron_buckets.py rebuilds where each parameter lies in them);
- the legacy per-rank iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt, tensor-parallel shards
  concatenated, memory-mapped; the Adam state from the distributed optimizer's distrib_optim.pt beside it,
  or else from the non-distributed optimizer's state_dict in the file (torch's, indexed by param group in
  model order: megatron_buckets.plain_slots).
The step is the iteration, the optimizer step its param groups' (or parameters') step, the learning
rate the one the saved OptimizerParamScheduler gives next, the loss scale its grad scaler's, the data
position the arguments' consumed_train_samples (megatron_state.py). The model and the job come from
--config (the train script or arguments, through ms_llm.convert's Megatron-LM reader) or else from the
arguments Megatron-LM stored in the checkpoint.

Write: latest_checkpointed_iteration.txt and iter_NNNNNNN/ in torch_dist, keys as megatron-core's
GPTModel.sharded_state_dict names them (one chunk per layer, so one layer's tensor is in memory at a
time), the Adam state as the distributed optimizer's fully_reshardable (loadable under any tp, pp and
dp), the scheduler in samples as Megatron-LM counts them (from --job, else constant at the checkpoint's
learning rate: then --override-opt_param-scheduler), the arguments Megatron-LM saves (as its parse_args holds
them for the launch script ms_llm.convert writes from --job, else from the model and ms_llm's default
settings), which an import without --config reads back to the same model. No RNG state (ms_llm's
generators are not Megatron's): Megatron-LM loads it with --no-load-rng.
"""
from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.interop import names
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.storage.untrusted import confined, parse_json, read_regular
from ms_llm.config.model import ModelConfig
from ms_llm.errors import CheckpointError
from ms_llm.job import job_from_dict
from ms_llm.strategy.ir import ParallelStrategy
from torch_backend.checkpoint import DTYPE_NAMES, TORCH_DTYPES, from_numpy, to_numpy
from torch_backend.interop.megatron_buckets import Buckets, plain_slots, rank_params, stage_layers, tp_merge
from torch_backend.interop.megatron_files import DistFolder, TensorChunk, unpickle, write_dist
from torch_backend.interop.megatron_state import (common_state, export_job, job_and_model, saved_args,
                                                  training_state)

TRACKER = "latest_checkpointed_iteration.txt"
STATES = ("exp_avg", "exp_avg_sq")
# Optimizer layouts in a torch_dist checkpoint: the plain optimizer's (None) and the distributed one's.
READ_SHARDINGS = (None, "dp_reshardable", "fully_reshardable")
DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def detect(folder: Path) -> bool:
    folder = Path(folder)
    # MindFormers 2.x writes the same tracker file beside iteration_NNNNNNNN folders: Megatron's are
    # iter_NNNNNNN (or release).
    if (folder / TRACKER).is_file() and (any(folder.glob("iter_*")) or (folder / "release").is_dir()):
        return True
    if any(folder.glob("mp_rank_*/model_optim_rng.pt")):
        return True
    meta = folder / "metadata.json"
    if not meta.is_file() or meta.stat().st_size > 4096:
        return False
    try:
        return parse_json(read_regular(meta), str(meta)).get("sharded_backend") == "torch_dist"
    except (CheckpointError, AttributeError):
        return False


def megatron_keys(model: ModelConfig) -> dict[str, tuple[bool, list[list[str]], str]]:
    """Megatron key -> (stacked over layers, per layer (or once) the Hugging Face tensors fused in it, how)."""
    out: dict[str, tuple[bool, dict[int, list[str]], str]] = {}
    for hf in layout_plan(model, ParallelStrategy(dp=1), 1).params:
        parts, kind = names.megatron_parts(hf, model)
        layer = names.megatron_layer_name(hf)
        entry = out.setdefault(names.megatron_key(hf), (layer is not None, {}, kind))
        entry[1][layer[0] if layer else 0] = parts
    return {key: (stacked, [d[i] for i in sorted(d)], kind) for key, (stacked, d, kind) in out.items()}


# ---- reading ----------------------------------------------------------------------------------------

class _Source:
    """One iteration folder: its common state, weights by Megatron key and layer, Adam state (from the
    distributed optimizer's buckets when it keeps them so)."""
    common: dict
    optimizer: dict
    groups: list[dict]
    buckets: Optional[Buckets] = None

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.param_steps: set = set()       # the optimizer step each parameter's state holds, where it is kept so

    @property
    def iteration(self) -> Any:
        return self.common.get("iteration")

    def has_moment(self, state: str) -> bool:
        return self.buckets is not None and self.buckets.has(state)

    def moment(self, state: str, key: str, layer: Optional[int]) -> torch.Tensor:
        return self.buckets.read(state, key, layer)


class _Dist(_Source):
    """An iter_NNNNNNN folder in torch_dist: weights and Adam state by Megatron key, layer by layer."""

    def __init__(self, folder: Path):
        meta = parse_json(read_regular(confined(folder, "metadata.json", "metadata.json")), f"{folder}/metadata.json")
        if not isinstance(meta, dict) or meta.get("sharded_backend") != "torch_dist":
            raise CheckpointError(f"{folder}/metadata.json: sharded_backend is {meta.get('sharded_backend')!r}; "
                                  "ms_llm reads megatron-core's torch_dist checkpoints (--ckpt-format torch_dist)")
        self.folder, self.files = folder, DistFolder(folder)
        self.common = unpickle(confined(folder, "common.pt", "common.pt"), f"{folder}/common.pt")
        if not isinstance(self.common, dict):
            raise CheckpointError(f"{folder}/common.pt: holds a {type(self.common).__name__}, not megatron-core's "
                                  "common state dict")
        self.optimizer = self.common.get("optimizer") or {}
        self.sharding = self.optimizer.get("param_state_sharding_type")
        self.groups = _param_groups(self.optimizer)
        super().__init__()

    def bind(self, model: ModelConfig, args) -> None:
        if self.sharding not in READ_SHARDINGS:
            raise CheckpointError(f"{self.folder}/common.pt: the distributed optimizer's state is in the deprecated "
                                  f"{self.sharding!r} layout; ms_llm reads dp_reshardable (Megatron-LM's default) and "
                                  "fully_reshardable (--dist-ckpt-optim-fully-reshardable): re-save in one of them")
        if self.sharding == "dp_reshardable":
            self.buckets = Buckets.from_dist(self.files, model, args, str(self.folder))
            self.optimizer = {**self.optimizer, **self.buckets.common}    # its param groups and grad scaler
            self.groups = _param_groups(self.optimizer)
        missing = [s for s in STATES if not self.has_moment(s)]
        if missing and self.sharding is not None:
            raise CheckpointError(f"{self.folder}: optimizer state ({self.sharding}) holds no {missing[0]}")

    def weight(self, key: str, layer: Optional[int]) -> Optional[torch.Tensor]:
        for name in (key, _alias(key)):
            if name and self.files.has_tensor(name):
                return self.files.layer(name, layer)
        return None

    def dtype(self, key: str, layer: Optional[int]) -> Optional[torch.dtype]:
        found = [n for n in (key, _alias(key)) if n and self.files.has_tensor(n)]
        return self.files.dtype(found[0]) if found else None

    def has_moment(self, state: str) -> bool:
        if self.buckets is not None:
            return self.buckets.has(state)
        return self.files.has_tensor(f"optimizer.state.{state}.embedding.word_embeddings.weight")

    def moment(self, state: str, key: str, layer: Optional[int]) -> torch.Tensor:
        if self.buckets is not None:
            return self.buckets.read(state, key, layer)
        return self.files.layer(f"optimizer.state.{state}.{key}", layer)


class _Legacy(_Source):
    """An iter_NNNNNNN folder of per-rank model_optim_rng.pt files (torch.save, memory-mapped)."""
    plain: Optional[dict] = None        # the non-distributed optimizer's state, when the files hold it

    def __init__(self, folder: Path):
        ranks = {}
        for entry in sorted(folder.iterdir()):
            m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?", entry.name)
            if m and m.group(3):
                raise CheckpointError(f"{entry}: an expert-parallel rank; ms_llm imports dense models only")
            if m:
                ranks[(int(m.group(1)), int(m.group(2) or 0))] = entry.name
        if not ranks:
            raise CheckpointError(f"{folder}: neither metadata.json (torch_dist) nor mp_rank_XX folders (legacy)")
        self.tp, self.pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
        for t in range(self.tp):
            for p in range(self.pp):
                if (t, p) not in ranks:
                    raise CheckpointError(f"{folder}: lacks the folder of tensor-parallel rank {t}, pipeline rank {p} "
                                          f"(mp_rank_{t:02d}{f'_{p:03d}' if self.pp > 1 else ''})")
        self.folder, self.names = folder, ranks
        self.files = {r: self._load(name, "model_optim_rng.pt") for r, name in ranks.items()}
        self.common = self.files[(0, 0)]
        args = self.common.get("args")
        for what, have in (("tensor", self.tp), ("pipeline", self.pp)):
            want = getattr(args, f"{what}_model_parallel_size", have)
            if isinstance(want, int) and want != have:
                raise CheckpointError(f"{folder}: holds {have} {what}-parallel rank folder(s) (mp_rank_*), its "
                                      f"arguments say {what}_model_parallel_size {want}: a rank's folder is missing")
        if not isinstance(self.files[(0, 0)].get("model"), dict):
            raise CheckpointError(f"{folder}/{ranks[(0, 0)]}/model_optim_rng.pt: has no 'model' state dict")
        self.optimizer = self.common.get("optimizer") or {}
        self.groups = _param_groups(self.optimizer)
        super().__init__()

    def _load(self, rank_folder: str, name: str) -> dict:
        path = confined(self.folder, f"{rank_folder}/{name}", name)
        out = unpickle(path, str(path), mmap=True)
        if not isinstance(out, dict):
            raise CheckpointError(f"{path}: holds a {type(out).__name__}, not Megatron-LM's state dict")
        return out

    def bind(self, model: ModelConfig, args) -> None:
        self.stages = stage_layers(model.num_layers, self.pp, args)
        if (self.folder / self.names[(0, 0)] / "distrib_optim.pt").is_file():
            states = {r: self._load(name, "distrib_optim.pt") for r, name in self.names.items()}
            self.buckets = Buckets.from_legacy(states, model, args, self.tp, self.pp, str(self.folder))
        else:
            self.plain = self._plain(model, args)

    def _plain(self, model: ModelConfig, args) -> Optional[dict]:
        """The non-distributed optimizer's state (its state_dict in model_optim_rng.pt): per parameter and
        tensor-parallel rank, its exp_avg, exp_avg_sq and (16-bit models) fp32 master; None with a note
        when the file holds none that ms_llm can place."""
        out: dict = {}
        decay_qk = getattr(args, "apply_wd_to_qk_layernorm", False) is True
        for (t, p), name in self.names.items():
            saved = self.files[(t, p)].get("optimizer")
            inner = saved.get("optimizer", saved) if isinstance(saved, dict) else None
            state = inner.get("state") if isinstance(inner, dict) else None
            if not state:
                why = (f"holds {len(saved)} chained optimizers' states" if isinstance(saved, list)
                       else "holds no optimizer state")
                self.notes.append(f"the legacy checkpoint {why} (mp_rank folder {name}): the Adam moments were not "
                                  "carried and start from zero")
                return None
            params = rank_params(model, "local", self.tp, p, self.pp, self.stages)
            slots = plain_slots(params, _param_groups(saved), decay_qk)
            if slots is None:
                mults = [g.get("wd_mult") for g in _param_groups(saved)]
                self.notes.append(f"the legacy checkpoint's param groups (wd_mult {mults}) are not megatron-core's "
                                  "default ones for this model's parameters: the Adam moments were not carried and "
                                  "start from zero")
                return None
            masters = saved.get("fp32_from_fp16_params") if isinstance(saved, dict) else None
            for (key, layer, shape), (g, j, index) in zip(params, slots):
                entry = state.get(index)
                found = {s: entry.get(s) for s in STATES} if isinstance(entry, dict) else {}
                if masters is not None:
                    found["param"] = masters[g][j] if isinstance(masters, list) and g < len(masters) \
                        and isinstance(masters[g], list) and j < len(masters[g]) else None
                if not found or any(not isinstance(v, torch.Tensor) or tuple(v.shape) != shape for v in found.values()):
                    raise CheckpointError(f"{self.folder}/{name}/model_optim_rng.pt: the optimizer state of parameter "
                                          f"{index} is not {key!r} {list(shape)} of layer {layer}: the optimizer state "
                                          "of another model?")
                out[(key, layer, t)] = found
                if isinstance(entry.get("step"), (int, float, torch.Tensor)):
                    self.param_steps.add(float(entry["step"]))
        return out

    def has_moment(self, state: str) -> bool:
        if self.buckets is not None:
            return self.buckets.has(state)
        return self.plain is not None and state in next(iter(self.plain.values()), {})

    def moment(self, state: str, key: str, layer: Optional[int]) -> torch.Tensor:
        if self.buckets is not None:
            return self.buckets.read(state, key, layer)
        return tp_merge(key, [self.plain[(key, layer, t)][state].float() for t in range(self.tp)])

    def _shards(self, key: str, layer: Optional[int]) -> Optional[list[torch.Tensor]]:
        """The tensor-parallel shards of `key` (memory-mapped), None when the files lack it."""
        stage, local = (self.stages[layer] if layer is not None
                        else (0, None) if key.startswith("embedding") else (self.pp - 1, None))
        prefix = "decoder.layers." if layer is not None else ""
        suffix = key[len(prefix):]
        shards = []
        for t in range(self.tp):
            model = self.files[(t, stage)]["model"]
            found = [f"{prefix}{local}.{s}" if layer is not None else s for s in (suffix, _alias(suffix)) if s]
            found = [n for n in found if n in model]
            if not found:
                return None
            shards.append(model[found[0]])
        return shards

    def weight(self, key: str, layer: Optional[int]) -> Optional[torch.Tensor]:
        shards = self._shards(key, layer)
        return None if shards is None else tp_merge(key, shards)

    def dtype(self, key: str, layer: Optional[int]) -> Optional[torch.dtype]:
        shards = self._shards(key, layer)
        return None if shards is None else shards[0].dtype

def _alias(key: str) -> Optional[str]:
    for new, old in names.MEGATRON_NORM_ALIASES.items():
        if key.endswith(new):
            return key[: -len(new)] + old
    return None


def _param_groups(optimizer: dict) -> list[dict]:
    inner = optimizer.get("optimizer", optimizer) if isinstance(optimizer, dict) else {}
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _iteration_folder(folder: Path) -> Path:
    if (folder / TRACKER).is_file():
        text = read_regular(confined(folder, TRACKER, TRACKER)).decode(errors="replace").strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise CheckpointError(f"{folder}/{TRACKER}: holds {text[:40]!r}; expected an iteration number or 'release'")
        path = confined(folder, name, f"the iteration {TRACKER} names")
        if not path.is_dir():
            raise CheckpointError(f"{folder}/{TRACKER}: names iteration {text}, but {path} does not exist")
        return path
    return folder


def read_run(folder: Path, config: Optional[Path] = None) -> ForeignRun:
    it = _iteration_folder(Path(folder))
    source = _Dist(it) if (it / "metadata.json").is_file() else _Legacy(it)
    args = source.common.get("args")
    job, model, notes = job_and_model(config, args, it)
    if model.moe is not None or model.mla is not None or model.mtp_layers:
        raise CheckpointError(f"{it}: the model has MoE / multi-latent attention / MTP layers; ms_llm imports dense "
                              "Megatron-LM GPT models only")
    step = source.iteration
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{it}: 'iteration' is {step!r}; expected the iteration number")
    source.bind(model, args)
    tensors = _tensors(source, model, str(it))
    state, more = training_state(source, args, model, job, step)
    return ForeignRun("megatron", model, step, tensors, state, job, notes + source.notes + more)


def _tensors(source, model: ModelConfig, where: str) -> dict[str, LazyTensor]:
    """Every weight (and Adam moment, and fp32 master weight of a 16-bit model) under ms_llm names,
    each read when asked for; the q/k/v and gate/up parts of one Megatron tensor read it once."""
    plan = layout_plan(model, ParallelStrategy(dp=1), 1).params
    last: dict[tuple, np.ndarray] = {}

    def fused(what: tuple, read: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> np.ndarray:
        if what not in last:
            last.clear()
            t = read()
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{where}: {what[0]} {what[1]!r} of layer {what[2]} has shape {list(t.shape)}, "
                                      f"the model's is {list(shape)}; the state of another model?")
            last[what] = to_numpy(t.float() if what[0] != "weight" else t)
        return last[what]

    def part(what, read, shape, kind, index):
        return np.ascontiguousarray(names.megatron_split(fused(what, read, shape), kind, model)[index])

    moments = [s for s in STATES if source.has_moment(s)]
    master = [s for s in ("param", "fp32_param") if source.has_moment(s)] if model.dtype != "float32" else []
    out = {}
    for key, (stacked, layers, kind) in megatron_keys(model).items():
        shape = (sum(plan[p].shape[0] for p in layers[0]), *plan[layers[0][0]].shape[1:])
        for i, parts in enumerate(layers):
            layer = i if stacked else None
            dtype = source.dtype(key, layer)
            if dtype is None:
                raise CheckpointError(f"{where}: has no tensor {key!r} (model {model.name!r}: is the config the "
                                      "checkpoint's?)")
            for index, hf in enumerate(parts):
                out[hf] = LazyTensor(plan[hf].shape, DTYPE_NAMES[dtype], partial(
                    part, ("weight", key, layer), partial(source.weight, key, layer), shape, kind, index))
                for state in moments + master[:1]:
                    name = optim_name("master" if state in ("param", "fp32_param") else state, hf)
                    out[name] = LazyTensor(plan[hf].shape, "float32", partial(
                        part, (state, key, layer), partial(source.moment, state, key, layer), shape, kind, index))
    return out


# ---- writing --------------------------------------------------------------------------------------------

def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    model, step = ckpt.model_config(), ckpt.step
    if model.moe is not None or model.mla is not None or model.mtp_layers:
        raise CheckpointError(f"{ckpt.folder}: MoE / multi-latent attention / MTP models have no Megatron-LM export")
    config = export_job(job, model, ckpt.state, step)
    train = config.train if job else None
    have = set(ckpt.names())
    plan = layout_plan(model, ParallelStrategy(dp=1), 1).params
    with_optim = all(optim_name(s, n) in have for s in STATES for n in plan)

    def fuse(parts: list[str], kind: str, state: Optional[str], stacked: bool) -> torch.Tensor:
        """One layer's (or the whole) Megatron tensor of a weight or its optimizer state."""
        found = [optim_name(state, p) if state in STATES
                 else optim_name("master", p) if state == "param" and optim_name("master", p) in have else p
                 for p in parts]
        t = from_numpy(names.megatron_fuse([ckpt.read_full(n) for n in found], kind, model), ckpt.entry(found[0]).dtype)
        t = t.float() if state is not None else t
        return t.unsqueeze(0) if stacked else t

    chunks: list[TensorChunk] = []
    states = [(None, "")] + ([(s, f"optimizer.state.{s}.") for s in ("param", *STATES)] if with_optim else [])
    for key, (stacked, layers, kind) in megatron_keys(model).items():
        one = (sum(plan[p].shape[0] for p in layers[0]), *plan[layers[0][0]].shape[1:])
        size = (len(layers), *one) if stacked else one
        for state, prefix in states:
            dtype = torch.float32 if state else TORCH_DTYPES[ckpt.entry(layers[0][0]).dtype]
            for i, parts in enumerate(layers):
                offsets = (i,) + (0,) * len(one) if stacked else None
                make = partial(fuse, parts, kind, state, stacked)
                chunks.append(TensorChunk(prefix + key, size, dtype, offsets, make))
    # Every linear's _extra_state (Transformer Engine's fp8 metadata; None without fp8), as both layer
    # specs ask for them: the local spec's four, Transformer Engine's core attention too.
    objects = {f"decoder.layers.{m}._extra_state/shard_{i}_{model.num_layers}": [None]
               for m in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                         "mlp.linear_fc2", "self_attention.core_attention") for i in range(model.num_layers)}
    folder = Path(out) / f"iter_{step:07d}"
    write_dist(folder, chunks, objects)
    args = saved_args(config, model, Path(out))
    torch.save(common_state(model, step, ckpt.state, train, with_optim, args), folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps(DIST_METADATA))
    (Path(out) / TRACKER).write_text(str(step))          # last: names the iteration once it is whole
    return Path(out)
