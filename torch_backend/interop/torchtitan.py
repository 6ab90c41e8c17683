"""torchtitan 0.3 training checkpoints <-> ms_llm (`ms-llm import-run` / `export-run --to torchtitan`).

torchtitan's CheckpointManager saves one DCP folder per save, <dump_folder>/<checkpoint.folder>/step-N:
    model weights      its LLaMA names (tok_embeddings.weight, layers.N.attention.qkv_linear.wq.weight, ...,
                       lm_head.weight), q/k rows in Meta's interleaved rotary order (names.py permutes them)
    optimizer.state.<param>.{step, exp_avg, exp_avg_sq}   OptimizersContainer's flat state, keyed by
                       parameter name: the llama3 flavors fuse q/k/v into one parameter, so their moments
                       are one wqkv tensor whose rows run per kv head [its query heads, its key, its value]
    optimizer.param_groups.<param>.{lr, betas, eps, weight_decay, ...}   lr is the next step's
    lr_scheduler.last_epoch, train_state.{step, ntokens_seen}
    dataloader         the data loader's own pickle: never read (its position is in torchtitan's dataset,
                       not in ms_llm's data order, which continues from the step)
Everything is read through DcpEntries (torch_backend/dcp.py): the metadata by an unpickler that knows
only DCP's classes, values with torch.load(weights_only=True), one tensor at a time.

The checkpoint holds no head count and no training settings, so read_run needs the run's config:
torchtitan's TOML or 0.3 command line (ms_llm/convert/torchtitan), or an ms_llm job YAML (a flavor
ms_llm has no model file for: `ms-llm convert-strategy CONFIG --model MODEL.yaml -o job.yaml`);
a folder ms_llm exported names its model in one more entry and reads back without one.

write_run writes step-N the same way, with the fused wqkv moments of 0.3's llama3 flavors. torchtitan
resumes from it with `--checkpoint.folder <out> --checkpoint.exclude_from_loading dataloader`, or
`--checkpoint.initial_load_path <out>/step-N --checkpoint.no-initial_load_model_only`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ms_llm.checkpoint import Checkpoint, optim_name, split_optim_name
from ms_llm.checkpoint.interop import names
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
from ms_llm.checkpoint.storage.untrusted import parse_json
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.convert import Converted, detect_format, read as read_config
from ms_llm.convert.common import ConversionError, ReadOptions
from ms_llm.errors import CheckpointError, MsLlmError
from ms_llm.job import job_to_dict, load_section, read_text
from ms_llm.run.lr import lr_at
from torch_backend.checkpoint import DTYPE_NAMES, to_numpy
from torch_backend.dcp import DcpEntries, save_streamed

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_FOLDER = re.compile(r"step-(\d+)")
FUSED = "attention.qkv_linear.wqkv.weight"
# The ms_llm model an export was written from (one entry torchtitan never asks for), so it imports back
# without --config.
MODEL_KEY = "ms_llm.model"
# Files of Megatron-core's torch_dist format, which is DCP too: a folder with them is not torchtitan's.
MEGATRON_FILES = ("metadata.json", "common.pt")


def _step_folder(folder: Path) -> Optional[Path]:
    """`folder` itself when it is a DCP folder, else its newest step-N child that is one
    (torchtitan's own choice when it resumes: CheckpointManager._find_load_step)."""
    if (folder / ".metadata").is_file():
        return folder
    steps = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := STEP_FOLDER.fullmatch(p.name)) and (p / ".metadata").is_file()]
    return max(steps)[1] if steps else None


def detect(folder: Path) -> bool:
    folder = Path(folder)
    if not folder.is_dir():
        return False
    step = _step_folder(folder)
    return (step is not None and any(step.glob("*.distcp"))
            and not any((step / f).exists() for f in MEGATRON_FILES))


# ---- import -------------------------------------------------------------------------------------

def read_run(folder: Path, config: Optional[Path]) -> ForeignRun:
    folder = Path(folder)
    step_folder = _step_folder(folder) if folder.is_dir() else None
    if step_folder is None:
        raise CheckpointError(f"{folder}: no torchtitan checkpoint here (a step-N folder holding DCP's .metadata)")
    entries = DcpEntries(step_folder)
    if config is None and entries.has(MODEL_KEY):         # an ms_llm export: it names its model
        model, job, notes = _exported_model(entries), None, []
    else:
        conv = _converted(config, step_folder, _writers(entries))
        model, job, notes = conv.job.model, job_to_dict(conv.job), list(conv.warnings)
    step = _integer(entries, "train_state.step")
    tensors, params = {}, []
    for key, (shape, dtype) in entries.tensors.items():
        if key.startswith("optimizer."):
            continue
        hf = _hf(key, step_folder)
        if hf == "lm_head.weight" and model.tie_embeddings:
            continue
        tensors[hf] = LazyTensor(shape, _dtype_name(dtype, key, step_folder), _weight_reader(entries, key, model))
    for key in entries.tensors:
        m = re.fullmatch(r"optimizer\.state\.(.+)\.exp_avg", key)
        if m:
            params.append(m.group(1))
            tensors.update(_moments(entries, m.group(1), model, step_folder))
    if not params:
        raise CheckpointError(f"{step_folder}: holds no optimizer state (optimizer.state.*.exp_avg); a model-only "
                              "checkpoint converts with `ms-llm convert-checkpoint --from dcp --names torchtitan`")
    state = {"optimizer_step": _integer(entries, f"optimizer.state.{params[0]}.step"),
             "lr": float(_value(entries, f"optimizer.param_groups.{params[0]}.lr", (int, float)))}
    if state["optimizer_step"] > step:
        raise CheckpointError(f"{step_folder}: optimizer.state.{params[0]}.step is {state['optimizer_step']} but "
                              f"train_state.step is {step}")
    if entries.has("dataloader") or any(k.startswith("dataloader.") for k in entries.metadata.state_dict_metadata):
        notes.append("torchtitan's data loader state is not carried: ms_llm's data order continues from step "
                     f"{step} (set train.data to the run's tokenized data)")
    return ForeignRun("torchtitan", model, step, tensors, state, job, notes)


def _converted(config: Optional[Path], folder: Path, world: Optional[int]) -> Converted:
    """The run's config as an ms_llm job; the world size for torchtitan's data_parallel_shard_degree = -1
    is the number of ranks that wrote the checkpoint."""
    if config is None:
        raise CheckpointError(f"{folder}: a torchtitan checkpoint records neither the head count nor the training "
                              "settings; pass --config with the run's torchtitan TOML or command line (or an ms_llm "
                              "job YAML)")
    text = read_text(Path(config))
    fmt = detect_format(text, str(config))
    try:
        return read_config(text, str(config), fmt, ReadOptions(world_size=world if fmt == "torchtitan" else None))
    except ConversionError as exc:
        if "--model" not in str(exc):
            raise
        raise ConversionError(f"{exc}; for import-run, convert it first (ms-llm convert-strategy {config} --model "
                              "MODEL.yaml -o job.yaml) and pass that job as --config") from None


def _exported_model(entries: DcpEntries) -> ModelConfig:
    text = _value(entries, MODEL_KEY, (str,))
    try:
        return from_dict(ModelConfig, parse_json(text.encode(), f"{entries.folder}: {MODEL_KEY}"), "model")
    except MsLlmError as exc:
        raise CheckpointError(f"{entries.folder}: {MODEL_KEY}: {exc}") from None


def _writers(entries: DcpEntries) -> Optional[int]:
    """Ranks that wrote the folder (DCP names each rank's files __<rank>_<n>.distcp)."""
    ranks = {int(m.group(1)) for info in entries.metadata.storage_data.values()
             if (m := re.match(r"__(\d+)_", str(info.relative_path)))}
    return max(ranks) + 1 if ranks else None


def _hf(key: str, folder: Path) -> str:
    try:
        return names.hf_name_of_torchtitan(key)
    except CheckpointError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


def _dtype_name(dtype: torch.dtype, key: str, folder: Path) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{folder}: tensor {key!r} has dtype {dtype}, which ms_llm cannot store")
    return DTYPE_NAMES[dtype]


def _weight_reader(entries: DcpEntries, key: str, model: ModelConfig):
    return lambda: names.from_torchtitan(key, to_numpy(entries.read(key)), model)[1]


def _moments(entries: DcpEntries, param: str, model: ModelConfig, folder: Path) -> dict[str, LazyTensor]:
    """The Adam moments of torchtitan parameter `param` under ms_llm names, in fp32; a fused wqkv
    splits into q_proj, k_proj and v_proj."""
    out = {}
    for moment in MOMENTS:
        key = f"optimizer.state.{param}.{moment}"
        if not entries.has(key):
            raise CheckpointError(f"{folder}/.metadata: lacks {key!r}")
        if not param.endswith(FUSED):
            hf = _hf(param, folder)
            if hf == "lm_head.weight" and model.tie_embeddings:
                continue
            shape = entries.tensors[key][0]
            out[optim_name(moment, hf)] = LazyTensor(shape, "float32", _moment_reader(entries, key, param, model))
            continue
        layer = param[:-len(FUSED)]
        rows, cols = entries.tensors[key][0]
        kv, hd = model.num_kv_heads, model.head_dim
        if rows != (model.num_heads + 2 * kv) * hd:
            raise CheckpointError(f"{folder}: {key} has {rows} rows but the model's q/k/v have "
                                  f"({model.num_heads} + 2 x {kv}) heads x {hd}; the state of a different model?")
        for part, width in (("wq", model.num_heads * hd), ("wk", kv * hd), ("wv", kv * hd)):
            tt = f"{layer}attention.qkv_linear.{part}.weight"
            out[optim_name(moment, _hf(tt, folder))] = LazyTensor(
                (width, cols), "float32", _fused_reader(entries, key, part, tt, model))
    return out


def _moment_reader(entries: DcpEntries, key: str, param: str, model: ModelConfig):
    return lambda: names.from_torchtitan(param, to_numpy(entries.read(key).float()), model)[1]


def _fused_reader(entries: DcpEntries, key: str, part: str, tt: str, model: ModelConfig):
    def read() -> np.ndarray:
        return names.from_torchtitan(tt, unfuse(to_numpy(entries.read(key).float()), model)[part], model)[1]
    return read


def unfuse(wqkv: np.ndarray, model: ModelConfig) -> dict[str, np.ndarray]:
    """torchtitan's FusedQKVLinear rows (n_kv, heads per kv + 2, head_dim, dim) -> wq, wk, wv rows
    (its _split_qkv_on_save)."""
    kv, per = model.num_kv_heads, model.num_heads // model.num_kv_heads
    w = wqkv.reshape(kv, per + 2, model.head_dim, wqkv.shape[-1])
    return {"wq": w[:, :per].reshape(-1, w.shape[-1]), "wk": w[:, per].reshape(-1, w.shape[-1]),
            "wv": w[:, per + 1].reshape(-1, w.shape[-1])}


def fuse(wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, model: ModelConfig) -> np.ndarray:
    """The inverse of unfuse (FusedQKVLinear._merge_qkv_on_load)."""
    kv, per, hd, cols = model.num_kv_heads, model.num_heads // model.num_kv_heads, model.head_dim, wq.shape[-1]
    parts = (wq.reshape(kv, per, hd, cols), wk.reshape(kv, 1, hd, cols), wv.reshape(kv, 1, hd, cols))
    return np.concatenate(parts, axis=1).reshape(-1, cols)


def _value(entries: DcpEntries, key: str, kinds: tuple[type, ...]) -> Any:
    if not entries.has(key):
        raise CheckpointError(f"{entries.folder}/.metadata: lacks {key!r}; not a torchtitan training checkpoint?")
    value = entries.read(key)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CheckpointError(f"{entries.folder}: {key!r} is {type(value).__name__}; expected "
                              f"{' or '.join(k.__name__ for k in kinds)}")
    return value


def _integer(entries: DcpEntries, key: str) -> int:
    value = _value(entries, key, (int, float))
    if value != int(value) or value < 0:
        raise CheckpointError(f"{entries.folder}: {key!r} is {value}; expected a step count")
    return int(value)


# ---- export -------------------------------------------------------------------------------------

def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    """<out>/step-N as torchtitan's CheckpointManager saves it; the optimizer's group settings come
    from `job` (ms_llm's defaults without one), the next step's lr from the checkpoint's state."""
    out = Path(out)
    model, step, state = ckpt.model_config(), ckpt.step, ckpt.state
    folder = out / f"step-{step}"
    if folder.exists():
        raise CheckpointError(f"{folder}: exists; write to another folder")
    train = load_section("train", job.get("train", {})) if job else TrainConfig()
    opt = train.optimizer
    lr = float(state.get("lr", lr_at(step, train)))
    entries: dict[str, Any] = {}
    weights = [n for n in ckpt.names() if not split_optim_name(n)]
    for name in weights:
        tt = names.torchtitan_name(name)
        entries[tt] = LazyTensor(ckpt.entry(name).shape, ckpt.entry(name).dtype, _exported(ckpt, name, name, model))
    if model.tie_embeddings:
        entries["lm_head.weight"] = entries["tok_embeddings.weight"]
    group = {k: v for k, v in torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr,
                                                betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                                weight_decay=opt.weight_decay).param_groups[0].items() if k != "params"}
    group["initial_lr"] = opt.lr
    for param, moments in _params(ckpt, weights, model).items():
        for moment, tensor in moments.items():
            entries[f"optimizer.state.{param}.{moment}"] = tensor
        entries[f"optimizer.state.{param}.step"] = torch.tensor(float(state.get("optimizer_step", step)))
        entries.update({f"optimizer.param_groups.{param}.{k}": v for k, v in group.items()})
    entries["lr_scheduler.last_epoch"] = step
    entries["train_state.step"] = step
    entries["train_state.ntokens_seen"] = step * train.global_batch_size * train.seq_len if job else 0
    entries[MODEL_KEY] = json.dumps(to_dict(model, full=True))       # torchtitan loads only what it asks for
    return save_streamed(entries, folder)


def _exported(ckpt: Checkpoint, name: str, hf: str, model: ModelConfig):
    """Reads tensor `name` of `ckpt` laid out as torchtitan holds ms_llm tensor `hf`."""
    return lambda: names.to_torchtitan(hf, ckpt.read_full(name), model)[1]


def _params(ckpt: Checkpoint, weights: list[str], model: ModelConfig) -> dict[str, dict[str, LazyTensor]]:
    """torchtitan parameter name -> its Adam moments, q/k/v fused per layer."""
    held = set(ckpt.names())
    out: dict[str, dict[str, LazyTensor]] = {}
    for name in weights:
        missing = [m for m in MOMENTS if optim_name(m, name) not in held]
        if missing:
            raise CheckpointError(f"{ckpt.folder}: has no {missing[0]} for {name!r}; torchtitan resumes the optimizer "
                                  "too (`ms-llm convert-checkpoint --to dcp --names torchtitan` writes weights alone)")
        if model.tie_embeddings and name == "lm_head.weight":
            continue
        tt = names.torchtitan_name(name)
        if ".attention.qkv_linear.w" in tt:
            if tt.endswith(".wq.weight"):
                out[tt.replace("wq.weight", "wqkv.weight")] = {m: _fused_moment(ckpt, name, m, model) for m in MOMENTS}
            continue
        out[tt] = {m: LazyTensor(ckpt.entry(name).shape, ckpt.entry(optim_name(m, name)).dtype,
                                 _exported(ckpt, optim_name(m, name), name, model)) for m in MOMENTS}
    return out


def _fused_moment(ckpt: Checkpoint, q_name: str, moment: str, model: ModelConfig) -> LazyTensor:
    hfs = [q_name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    rows = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim

    def read() -> np.ndarray:
        return fuse(*(names.to_torchtitan(hf, ckpt.read_full(optim_name(moment, hf)), model)[1] for hf in hfs),
                    model)
    return LazyTensor((rows, model.hidden_size), ckpt.entry(optim_name(moment, q_name)).dtype, read)
