"""MindFormers 2.1 training checkpoints <-> ms_llm (`ms-llm import-run` / `export-run --to mindformers`).

MindFormers' CheckpointMonitor saves a training state in one of two layouts (checkpoint_format:
safetensors):
    1.x / static graph (use_legacy_format: True, the default)
        <output>/checkpoint/rank_<r>/<prefix>_rank_<r>-<epoch>_<step>.safetensors, and meta.json naming
        the last one. A file holds what ms.save_checkpoint takes from the train network: the weights,
        the optimizer's adam_m.<weight> / adam_v.<weight> and global_step, scale_sense, and the appended
        epoch_num, step_num, global_step, loss_scale, global_batch_size.
    2.x (use_legacy_format: False)
        <output>/latest_checkpointed_iteration.txt and iteration_<8 digits>/ holding
        [<prefix>-]model-<rank>-<ranks>.safetensors (weights), [<prefix>-]opt-<rank>-<ranks>.safetensors
        (adam_m., adam_v., global_step) and common.json (epoch_num, step_num, global_step, loss_scale,
        global_batch_size).
    merged (a run saved by several ranks, merged by mindspore.unified_safetensors with its strategy
        files, as MindFormers' auto_trans_ckpt does): part*.safetensors of whole tensors and
        hyper_param.safetensors (the step counters and loss scale), which MindFormers resumes from.
Weights carry the names of MindFormers' LLaMA (the legacy LlamaForCausalLM that both layouts save;
MindFormers' own convert_weight.py renames Hugging Face tensors to them without permuting any row).
One rank's files or a merged folder are read; several ranks' slices are refused with the MindSpore
call that merges them. Tensors are read from the safetensors files one at a time (safetensors_io
headers, checked; pread of the tensor's bytes); a .ckpt file (1.x checkpoint_format: ckpt) is parsed
whole by mindspore.load_checkpoint (protobuf, no pickle) where MindSpore is installed.

Training state: step = step_num (steps taken, a skipped overflow step included), optimizer_step =
global_step (Adam's bias-correction count), the loss scale when it is not 1 (static, or dynamic with
the DynamicLossScaleUpdateCell's counters), the lr of the next step from the run's config.
MindFormers' data position is its dataset's own; ms_llm's data order continues from the step.

An export names its model in the safetensors metadata (ms_llm_model), so it imports back without
--config. write_run writes the 1.x layout of one rank (rank_0/CKP_rank_0-<epoch>_<step>.safetensors and
meta.json), which MindFormers resumes with `resume_training: True` and `load_checkpoint: <out>`
(`auto_trans_ckpt: True` to load it under another parallel config).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ms_llm.checkpoint import Checkpoint, optim_name, split_optim_name
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
from ms_llm.checkpoint.storage.safetensors_io import (TensorSpan, dtype_name, open_shard_file, read_header,
                                                     storage_dtype, write_file)
from ms_llm.checkpoint.storage.untrusted import confined, parse_json, read_regular
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.convert import read as read_config
from ms_llm.convert.common import ReadOptions
from ms_llm.errors import CheckpointError, MsLlmError
from ms_llm.job import job_to_dict, load_section, read_text
from ms_llm.mindspore.interop import mindformers_names as mcore
from ms_llm.run.loss_scale import GROWTH_INTERVAL
from ms_llm.run.lr import lr_at

LEGACY_FILE = re.compile(r"(.+)_rank_(\d+)-(\d+)_(\d+)\.safetensors")
LEGACY_CKPT = re.compile(r"(.+)_rank_(\d+)-(\d+)_(\d+)\.ckpt")
HYPER = "hyper_param.safetensors"
V2_FILE = re.compile(r"(?:(.+)-)?(model|opt)-(\d{7})-(\d{7})\.safetensors")
ITERATION = re.compile(r"iteration_(\d{8})")
TRACKER = "latest_checkpointed_iteration.txt"
MOMENTS = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}
# What a MindFormers training checkpoint holds beside weights and moments: its step counters, loss
# scale (and the dynamic scale cell's counters) and appended run facts.
RUN_VALUES = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size", "scale_sense",
              "current_iterator_step", "last_overflow_iterator_step")
SKIPPED_PREFIXES = ("accu_grads.",)         # gradient-accumulation buffers, not training state
MODEL_KEY = "ms_llm_model"          # safetensors metadata of an ms_llm export: its model, so it imports back alone
# Hugging Face (ms_llm) name -> MindFormers LLaMA name (models/llama/convert_weight.py's name_replace).
_TO_MINDFORMERS = {
    "model.embed_tokens.weight": "model.tok_embeddings.embedding_weight",
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight", "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "model.norm.weight": "model.norm_out.weight",
    "lm_head.weight": "lm_head.weight",
}
_FROM_MINDFORMERS = {v: k for k, v in _TO_MINDFORMERS.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def mindformers_name(name: str) -> str:
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _TO_MINDFORMERS:
        return f"model.layers.{m.group(1)}.{_TO_MINDFORMERS[m.group(2)]}"
    if name in _TO_MINDFORMERS:
        return _TO_MINDFORMERS[name]
    raise CheckpointError(f"tensor {name!r} has no MindFormers LLaMA name (dense LLaMA weights only)")


def hf_name(name: str, where: str) -> str:
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _FROM_MINDFORMERS:
        return f"model.layers.{m.group(1)}.{_FROM_MINDFORMERS[m.group(2)]}"
    if name in _FROM_MINDFORMERS:
        return _FROM_MINDFORMERS[name]
    raise CheckpointError(f"{where}: tensor {name!r} is not a weight of MindFormers' LLaMA (LlamaForCausalLM with "
                          "qkv_concat: False) nor its optimizer state")


# ---- finding a save ----------------------------------------------------------------------------

def detect(folder: Path) -> bool:
    folder = Path(folder)
    if folder.is_file():
        return bool(LEGACY_FILE.fullmatch(folder.name) or LEGACY_CKPT.fullmatch(folder.name))
    if not folder.is_dir():
        return False
    if any((folder / f).is_file() for f in ("common.json", HYPER)) or \
            any(ITERATION.fullmatch(p.name) for p in folder.iterdir()):
        return True
    ranks = folder / "rank_0" if (folder / "rank_0").is_dir() else folder
    return any(LEGACY_FILE.fullmatch(p.name) or LEGACY_CKPT.fullmatch(p.name) for p in ranks.iterdir())


def _legacy_file(folder: Path) -> Path:
    """The 1.x file to read: `folder` itself, or rank_0's (of a checkpoint folder) file meta.json
    names, else its latest by epoch and step (MindFormers' get_resume_checkpoint)."""
    if folder.is_file():
        return folder
    ranks = sorted(p.name for p in folder.iterdir() if re.fullmatch(r"rank_\d+", p.name))
    if len(ranks) > 1:
        raise CheckpointError(f"{folder}: holds {len(ranks)} ranks' slices; merge them with mindspore.unified_"
                              f"safetensors('{folder}', '<strategy file or folder>', '<out>') (MindFormers' "
                              "auto_trans_ckpt does the same) and import <out>")
    rank = folder / ranks[0] if ranks else folder
    meta = rank / "meta.json"
    if meta.is_file():
        name = parse_json(read_regular(meta), str(meta)).get("last_ckpt_file")
        if not isinstance(name, str) or not (LEGACY_FILE.fullmatch(name) or LEGACY_CKPT.fullmatch(name)):
            raise CheckpointError(f"{meta}: 'last_ckpt_file' is {name!r}; expected "
                                  "<prefix>_rank_<r>-<epoch>_<step>.safetensors")
        return confined(rank, name, "meta.json's last_ckpt_file")
    found = [(int(m.group(3)), int(m.group(4)), p) for p in rank.iterdir()
             if (m := LEGACY_FILE.fullmatch(p.name) or LEGACY_CKPT.fullmatch(p.name))]
    if not found:
        raise CheckpointError(f"{rank}: no MindFormers checkpoint (<prefix>_rank_<r>-<epoch>_<step>.safetensors)")
    return max(found)[2]


def _v2_files(folder: Path) -> tuple[list[Path], dict]:
    """The 2.x iteration folder's files (`folder` is it or the root its tracker points into) and
    its common.json."""
    if not (folder / "common.json").is_file():
        tracker = folder / TRACKER
        text = read_regular(tracker).decode(errors="replace").strip() if tracker.is_file() else ""
        if not text.isdigit():
            raise CheckpointError(f"{tracker}: expected the number of the last saved iteration, found {text[:40]!r}")
        folder = confined(folder, f"iteration_{int(text):08d}", f"the iteration {tracker.name} names")
    common = folder / "common.json"
    info = parse_json(read_regular(confined(folder, "common.json", "common.json")), str(common))
    files = [p for p in folder.iterdir() if V2_FILE.fullmatch(p.name)]
    ranks = {V2_FILE.fullmatch(p.name).group(4) for p in files}
    if ranks != {"0000001"}:
        raise CheckpointError(f"{folder}: files of {sorted(ranks) or 'no'} ranks; one rank's model-/opt- files are "
                              "read (merge a multi-rank save with MindFormers' checkpoint tools first)")
    return files, info if isinstance(info, dict) else {}


# ---- import ------------------------------------------------------------------------------------

class _File:
    """One safetensors file: checked header, and a tensor's bytes read when asked for."""

    def __init__(self, path: Path):
        self.path = path
        self.spans, self.metadata, _ = read_header(str(path))

    def read(self, key: str) -> np.ndarray:
        span: TensorSpan = self.spans[key]
        fd, _ = open_shard_file(str(self.path))
        try:
            data = os.pread(fd, span.nbytes, span.start)
        finally:
            os.close(fd)
        if len(data) != span.nbytes:
            raise CheckpointError(f"{self.path}: tensor {key!r}: read {len(data)} of {span.nbytes} bytes")
        return np.frombuffer(data, dtype=storage_dtype(span.dtype)).reshape(span.shape)

    def scalar(self, key: str) -> Optional[float]:
        if key not in self.spans:
            return None
        value = self.read(key)
        if value.size != 1:
            raise CheckpointError(f"{self.path}: {key!r} has shape {list(value.shape)}; expected one number")
        return float(value.reshape(-1)[0])


class _CkptFile(_File):
    """One MindSpore .ckpt file, parsed whole by mindspore.load_checkpoint as MindSpore loads it: a
    protobuf Checkpoint whose tensors are raw bytes with a dtype tag (strings as text); MindSpore's
    parser unpickles nothing. MindSpore caps such a file at 2 GB of protobuf; it is held in memory."""

    def __init__(self, path: Path):
        try:
            import mindspore as ms
        except ImportError:
            raise CheckpointError(f"{path}: a MindSpore .ckpt file is read with MindSpore, not installed here; convert "
                                  f"it with mindspore.ckpt_to_safetensors('{path}', '<out folder>') and import the "
                                  ".safetensors file it writes") from None
        try:
            params = ms.load_checkpoint(str(path), format="ckpt")
        except (ValueError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{path}: not a MindSpore checkpoint MindSpore can read "
                                  f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})"
                                  ) from None
        self.path, self.metadata, self.arrays = path, {}, {}
        for key, value in params.items():
            if isinstance(value, str):
                continue
            if value.dtype == ms.bfloat16:             # exact in float32; kept as bfloat16 bits
                bits = value.float().asnumpy().view(np.uint32) >> 16
                self.arrays[key] = ("bfloat16", bits.astype(np.uint16))
            else:
                array = value.asnumpy()
                self.arrays[key] = (dtype_name(array), array)
        self.spans = {k: TensorSpan(k, d, tuple(a.shape), 0, a.nbytes) for k, (d, a) in self.arrays.items()}

    def read(self, key: str) -> np.ndarray:
        return self.arrays[key][1]


def read_run(folder: Path, config: Optional[Path]) -> ForeignRun:
    folder = Path(folder)
    if folder.is_dir() and (folder / HYPER).is_file():
        paths, info = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file()), {}
    elif folder.is_dir() and ((folder / "common.json").is_file() or (folder / TRACKER).is_file()):
        paths, info = _v2_files(folder)
    else:
        paths, info = [_legacy_file(folder)], {}
    files = [_CkptFile(p) if p.suffix == ".ckpt" else _File(p) for p in paths]
    values: dict[str, float] = {}
    for f in files:
        values.update({k: v for k in RUN_VALUES if (v := f.scalar(k)) is not None})
    values.update({k: float(v) for k, v in info.items() if k in RUN_VALUES and isinstance(v, (int, float))})
    where = str(paths[0].parent)
    exported = next((f.metadata[MODEL_KEY] for f in files if MODEL_KEY in f.metadata), None)
    if config is None and exported is not None:     # an ms_llm export: it names its model
        job, model = None, _exported_model(exported, where)
    else:
        job = _job(config, where)
        model = job.model
    tensors: dict[str, LazyTensor] = {}
    for f in files:
        for key in f.spans:
            if key in RUN_VALUES or key.startswith(SKIPPED_PREFIXES):
                continue
            head, _, rest = key.partition(".")
            moment = MOMENTS.get(head)
            for name, shape, read in _hf_tensors(f, key, rest if moment else key, model):
                if moment:
                    tensors[optim_name(moment, name)] = LazyTensor(shape, "float32", _fp32(read))
                else:
                    tensors[name] = LazyTensor(shape, f.spans[key].dtype, read)
    step, optimizer_step = _count(values, "step_num", where), _count(values, "global_step", where)
    if optimizer_step > step:
        raise CheckpointError(f"{where}: global_step {optimizer_step} is past step_num {step}")
    state: dict[str, Any] = {"optimizer_step": optimizer_step}
    if job is not None:
        state["lr"] = lr_at(step, job.train)
    scale = _loss_scale(values, step, optimizer_step)
    if scale is not None:
        state["loss_scale"] = scale
    notes = ["MindFormers' data position is its dataset's: ms_llm's data order continues from step "
             f"{step} (set train.data to the run's tokenized data)"]
    return ForeignRun("mindformers", model, step, tensors, state, job_to_dict(job) if job else None, notes)


def _job(config: Optional[Path], where: str):
    if config is None:
        raise CheckpointError(f"{where}: a MindFormers checkpoint records neither the head count nor the training "
                              "settings; pass --config with the run's MindFormers YAML (or an ms_llm job YAML)")
    text = read_text(Path(config))
    return read_config(text, str(config), None, ReadOptions()).job


def _exported_model(text: str, where: str) -> ModelConfig:
    try:
        return from_dict(ModelConfig, parse_json(text.encode(), f"{where}: {MODEL_KEY}"), "model")
    except MsLlmError as exc:
        raise CheckpointError(f"{where}: {MODEL_KEY}: {exc}") from None


def _hf_tensors(f: _File, key: str, name: str, model: ModelConfig) -> list[tuple[str, tuple, Callable]]:
    """(ms_llm name, shape, reader) of each tensor file entry `key` (weight `name`) holds: one for a
    LLaMA (1.x) or unfused 2.x name, the parts of a fused 2.x tensor (mindformers_names)."""
    shape, read = tuple(f.spans[key].shape), _reader(f, key)
    parts = mcore.hf_parts(name)
    if parts is None:
        return [(hf_name(name, str(f.path)), shape, read)]
    if len(parts) == 1:
        return [(parts[0], shape, read)]
    return [(hf, mcore.part_shape(hf, shape, model), mcore.part_reader(name, i, read, model, f"{f.path}: {key}"))
            for i, hf in enumerate(parts)]


def _reader(f: _File, key: str):
    return lambda: f.read(key)


def _fp32(read: Callable[[], np.ndarray]):
    return lambda: read().astype(np.float32, copy=False)


def _count(values: dict[str, float], key: str, where: str) -> int:
    value = values.get(key)
    if value is None or value != int(value) or value < 0:
        raise CheckpointError(f"{where}: {key} is {value!r}; expected the number of steps taken")
    return int(value)


def _loss_scale(values: dict[str, float], step: int, optimizer_step: int) -> Optional[dict]:
    """ms_llm's LossScaler record of MindFormers' scale; None for a scale of 1 that never moves."""
    scale = values.get("loss_scale", values.get("scale_sense", 1.0))
    dynamic = "current_iterator_step" in values
    if scale == 1.0 and not dynamic:
        return None
    good = 0
    if dynamic:
        good = int(values["current_iterator_step"] - values.get("last_overflow_iterator_step", 0)) - 1
    return {"mode": "dynamic" if dynamic else "static", "scale": scale,
            "good_steps": max(0, min(good, step, GROWTH_INTERVAL - 1)), "skipped": step - optimizer_step}


# ---- export ------------------------------------------------------------------------------------

def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    """<out>/rank_0/CKP_rank_0-<epoch>_<step>.safetensors and meta.json, as CheckpointMonitor saves one
    rank: weights, adam_m / adam_v, global_step, scale_sense and the appended run values."""
    out = Path(out)
    step, state = ckpt.step, ckpt.state
    train = load_section("train", job.get("train", {})) if job else TrainConfig()
    epoch = int((state.get("sampler") or {}).get("epoch", 0)) + 1
    name = f"CKP_rank_0-{epoch}_{step}.safetensors"
    rank = out / "rank_0"
    if (rank / name).exists():
        raise CheckpointError(f"{rank / name}: exists; write to another folder")
    scale = float((state.get("loss_scale") or {}).get("scale", 1.0))
    values = {"global_step": ("int32", np.array([state.get("optimizer_step", step)], dtype=np.int32)),
              "scale_sense": ("float32", np.array(scale, dtype=np.float32)),
              "loss_scale": ("float32", np.array(scale, dtype=np.float32)),
              "epoch_num": ("int64", np.array(epoch, dtype=np.int64)),
              "step_num": ("int64", np.array(step, dtype=np.int64)),
              "global_batch_size": ("int64", np.array(train.global_batch_size, dtype=np.int64))}
    sources: dict[str, str] = {}
    for ours in ckpt.names():
        owned = split_optim_name(ours)
        if owned and owned[0] not in MOMENTS.values():
            continue                                   # fp32 masters: MindFormers keeps none apart
        prefix = {v: k for k, v in MOMENTS.items()}[owned[0]] + "." if owned else ""
        sources[prefix + mindformers_name(owned[1] if owned else ours)] = ours
    entries = [(k, ckpt.entry(v).dtype, tuple(ckpt.entry(v).shape)) for k, v in sources.items()]
    entries += [(k, d, a.shape) for k, (d, a) in values.items()]

    def fetch(key: str) -> np.ndarray:
        return values[key][1] if key in values else ckpt.read_full(sources[key])

    rank.mkdir(parents=True, exist_ok=True)
    metadata = {"remove_redundancy": "False", "format": "ms", MODEL_KEY: json.dumps(to_dict(ckpt.model_config()))}
    write_file(str(rank / name), entries, fetch, metadata)
    (rank / "meta.json").write_text(json.dumps({"last_epoch": epoch, "last_step": step, "last_ckpt_file": name}))
    return rank / name
