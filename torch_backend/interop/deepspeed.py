"""DeepSpeed ZeRO checkpoints <-> ms_llm (`ms-llm import-run` / `export-run --to deepspeed`).

What DeepSpeed 0.19's `engine.save_checkpoint(dir, tag)` writes for one model-parallel rank:
    dir/latest                                       the tag of the newest save ("global_step100")
    dir/<tag>/mp_rank_00_model_states.pt             ZeRO-1/2: the module's weights in the training dtype,
                                                     param_shapes, global_steps, skipped_steps,
                                                     lr_scheduler, ds_config
    dir/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt    ZeRO-3: the same per dp rank, weights empty
    dir/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   dp rank R's flat partition of the fp32
                                                     master weights and of Adam's exp_avg / exp_avg_sq
ZeRO-1/2 lay each parameter group out flat (param_shapes order, param_alignment_paddings after each)
and cut it into dp consecutive partitions; ZeRO-3 cuts every parameter into dp pieces of
ceil(numel / dp) elements (the last zero-padded), each rank holding its pieces one after another.
ds_to_universal's folder keeps zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt, each a whole tensor.

The names are those of the module DeepSpeed wrapped: Hugging Face's for transformers' models, which
are ms_llm's. The checkpoint holds no head count: the model comes from config.json, the model's
Hugging Face config that transformers' Trainer saves beside it (the folder, its parent, or beside
--config); --config ds_config.json (else the ds_config DeepSpeed recorded in the checkpoint) becomes
the job. Files are read with torch.load(weights_only=True, mmap=True): DeepSpeed's loss scaler and
fragment records are read as their attributes into inert stand-ins (_Peer), never as DeepSpeed's
classes, and one parameter's pieces are copied out of the mapped ranks at a time.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ms_llm import convert
from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor
from ms_llm.checkpoint.storage.untrusted import confined, integer, open_regular, read_regular
from ms_llm.config.hf import model_from_hf_config
from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import ConversionError, ReadOptions
from ms_llm.errors import CheckpointError
from ms_llm.job import job_to_dict
from ms_llm.run.lr import lr_at
from torch_backend.checkpoint import to_numpy

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"                      # ZeRO-0/1/2
RANK_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # ZeRO-3, one per dp rank
OPTIM_STATES = "{}zero_pp_rank_{}_mp_rank_00_optim_states.pt"      # prefix "bf16_" under bf16
MOMENTS = ("exp_avg", "exp_avg_sq")
HF_CONFIG = "config.json"


# ---- DeepSpeed's pickled objects ----------------------------------------------------------------

class _Peer:
    """A DeepSpeed object as its attributes: torch.load(weights_only=True) builds it with __new__ and a
    __dict__ update, so no DeepSpeed code runs (DeepSpeed need not even be installed); the export
    writes it back under PEER, the class DeepSpeed's own loader resolves."""
    PEER = ""


class LossScaler(_Peer):
    PEER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(_Peer):
    PEER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(_Peer):
    PEER = "deepspeed.utils.tensor_fragment.fragment_address"


# ZeroStageEnum is an IntEnum pickled as ZeroStageEnum(2): int(2) rebuilds its value.
SAFE_GLOBALS = [(c, c.PEER) for c in (LossScaler, DynamicLossScaler, FragmentAddress)] + \
               [(int, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def load(path: Path, what: str) -> dict:
    """One DeepSpeed file through torch.load(weights_only=True, mmap=True): tensors stay in the
    mapped file until sliced. Every failure is one line naming the file."""
    try:
        fd, _ = open_regular(path)          # a FIFO or a folder is refused before torch opens it
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what})") from None
    os.close(fd)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        reason = next((ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error" in ln),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise CheckpointError(f"{path}: torch.load(weights_only=True) refuses it ({reason}); ms_llm runs no code "
                              "from a checkpoint") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a whole torch file, truncated? ({first})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not DeepSpeed's dict of states")
    return data


def _field(data: Any, keys: str, path: Path, kind: type | tuple = object) -> Any:
    """data[k1][k2]... of a loaded file, of type `kind`; else one line naming the file and field."""
    value = data
    for key in keys.split("."):
        if not isinstance(value, dict) or key not in value:
            raise CheckpointError(f"{path}: lacks '{keys}'; not a DeepSpeed checkpoint file of this kind?")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CheckpointError(f"{path}: '{keys}' is a {type(value).__name__}; expected {kind}")
    return value


def _count(value: Any) -> int:
    """A step count as DeepSpeed stores it: int, or a 0-d tensor (torch's Adam)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


# ---- where the checkpoint is ----------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    """The folder of one save: `tag` holding the rank files, or a ds_to_universal folder."""
    root: Path
    tag: Path
    universal: bool


def _tag_file(root: Path, name: str) -> Optional[Path]:
    """The folder a `latest` pointer names, confined to `root`."""
    pointer = root / name
    if not pointer.is_file():
        return None
    raw = read_regular(pointer)[:4096].decode("utf-8", "replace").strip()
    return confined(root, raw, f"'{name}' (the tag of the newest save)")


def locate(folder: Path) -> Optional[Found]:
    """A DeepSpeed save from file names only: the folder itself, or the one `latest` (else
    `latest_universal`) names."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for tag, root in ((folder, folder.parent), (_tag_file(folder, LATEST), folder),
                      (_tag_file(folder, LATEST_UNIVERSAL), folder)):
        if tag is None or not tag.is_dir():
            continue
        if (tag / MODEL_STATES).is_file() or (tag / RANK_MODEL_STATES.format(0)).is_file():
            return Found(root, tag, (tag / "zero").is_dir())
    return None


def detect(folder: Path) -> bool:
    return locate(folder) is not None


# ---- the parameters' places in the flat partitions ------------------------------------------------

@dataclass(frozen=True)
class Place:
    """Parameter `name` of `shape` in flat group `group`: ZeRO-1/2 elements [offset, offset + numel)
    of the group's ranks laid end to end; ZeRO-3 `offset` into each rank's concatenated groups."""
    name: str
    shape: tuple[int, ...]
    group: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _shapes(groups: Any, path: Path, field: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """param_shapes: per group, (name, shape) in the flat order."""
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{path}: '{field}' is a {type(groups).__name__}; expected a list of name -> shape")
    out = []
    for g, shapes in enumerate(groups):
        group = []
        for name, shape in shapes.items():
            if not isinstance(name, str) or not isinstance(shape, (tuple, list)) or \
                    not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 40 for d in shape):
                raise CheckpointError(f"{path}: '{field}[{g}]' has {name!r}: {shape!r}; expected a name and a shape")
            group.append((name, tuple(int(d) for d in shape)))
        out.append(group)
    return out


Piece = tuple[int, int, int, int, int]      # (rank, group, start, count, at): see Ranks.read


class Ranks:
    """The dp ranks' optimizer files of one ZeRO save, read one parameter at a time."""

    def __init__(self, tag: Path, prefix: str, world: int, stage: int):
        self.tag, self.prefix, self.world, self.stage = tag, prefix, world, stage
        self.lengths: list[list[int]] = []          # [rank][group] elements of its fp32 partition
        self.meta: list[dict] = []                   # rank's optimizer_state_dict without tensors

    def path(self, rank: int) -> Path:
        return self.tag / OPTIM_STATES.format(self.prefix, rank)

    def flats(self, data: dict, rank: int, kind: str) -> list[torch.Tensor]:
        """Rank `rank`'s flat tensors of `kind` ("fp32" or a moment), one per group."""
        path, osd = self.path(rank), _field(data, "optimizer_state_dict", self.path(rank), dict)
        if kind == "fp32":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            flats = _field(osd, key, path, list)
        else:
            base = osd.get("optimizer_state_dict" if self.stage == 3 else "base_optimizer_state")
            states = base.get("state") if isinstance(base, dict) else base    # rigid dict / elastic list
            if isinstance(states, dict):
                states = [states[k] for k in sorted(states)]
            if not isinstance(states, list) or not all(isinstance(s, dict) and kind in s for s in states):
                raise CheckpointError(f"{path}: no '{kind}' per parameter group in the optimizer state; not Adam's?")
            flats = [s[kind] for s in states]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in flats):
            raise CheckpointError(f"{path}: the {kind} partitions are not flat tensors")
        return flats

    def open(self) -> None:
        """Check every rank's file and keep its partition sizes (its tensors are not read)."""
        for rank in range(self.world):
            data = load(self.path(rank), f"dp rank {rank} of the {self.world} the checkpoint was saved by "
                                         f"(partition_count {self.world}); every rank's optimizer file is needed")
            fp32 = self.flats(data, rank, "fp32")
            for kind in MOMENTS:
                moments = self.flats(data, rank, kind)
                if len(moments) != len(fp32) or any(m.numel() < f.numel() for m, f in zip(moments, fp32)):
                    raise CheckpointError(f"{self.path(rank)}: its {kind} partitions are shorter than its fp32 "
                                          "weights'")
            self.lengths.append([t.numel() for t in fp32])
            osd = data["optimizer_state_dict"]
            self.meta.append({"loss_scaler": osd.get("loss_scaler"),
                              "param_alignment_paddings": osd.get("param_alignment_paddings"),
                              **_hyper(osd.get("optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"))})
        groups = {len(g) for g in self.lengths}
        if len(groups) != 1:
            raise CheckpointError(f"{self.tag}: the ranks hold different numbers of parameter groups")

    def read(self, kind: str, pieces: list[Piece], total: int) -> np.ndarray:
        """One parameter's `kind` as an fp32 array of `total` elements from its pieces: elements
        [start, start + count) of rank `rank`'s flat `group`, laid at `at`. Each rank's file is
        mapped while its pieces are copied, then let go."""
        out = np.empty(total, np.float32)
        for rank in sorted({p[0] for p in pieces}):
            flats = self.flats(load(self.path(rank), f"dp rank {rank}"), rank, kind)
            for _, group, start, count, at in (p for p in pieces if p[0] == rank):
                out[at:at + count] = flats[group][start:start + count].detach().float().numpy()
            del flats
        return out


def _hyper(base: Any) -> dict:
    """The optimizer's step count and hyper-parameters: torch's {state, param_groups}, or the
    elastic layout's list of per-group states."""
    out: dict = {}
    if isinstance(base, dict):
        groups = base.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        states = base.get("state")
        states = [states[k] for k in sorted(states)] if isinstance(states, dict) else []
    else:
        states = base if isinstance(base, list) else []
    steps = [_count(s.get("step")) for s in states if isinstance(s, dict) and "step" in s]
    if not steps and out.get("groups"):
        steps = [_count(out["groups"][0].get("step"))]
    if steps:
        out["step"] = steps[0]
    return out


def zero12_places(shapes: list[list[tuple[str, tuple[int, ...]]]], paddings: Any) -> list[Place]:
    """ZeRO-1/2: each group laid out flat in order, param_alignment_paddings after each parameter."""
    places = []
    for g, group in enumerate(shapes):
        pad = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        offset = 0
        for i, (name, shape) in enumerate(group):
            places.append(Place(name, shape, g, offset))
            offset += math.prod(shape) + (pad[i] if isinstance(pad, list) and i < len(pad) else 0)
    return places


def zero3_places(shapes: list[list[tuple[str, tuple[int, ...]]]], world: int) -> list[Place]:
    """ZeRO-3: ceil(numel / world) elements of every parameter on each rank, one after another."""
    places, offset = [], 0
    for g, group in enumerate(shapes):
        for name, shape in group:
            places.append(Place(name, shape, g, offset))
            offset += -(-math.prod(shape) // world)
    return places


def _pieces12(place: Place, lengths: list[list[int]]) -> list[Piece]:
    """The (rank, group, start, count, at) pieces of a ZeRO-1/2 parameter."""
    pieces, begin = [], 0
    lo, hi = place.offset, place.offset + place.numel
    for rank, groups in enumerate(lengths):
        end = begin + groups[place.group]
        a, b = max(lo, begin), min(hi, end)
        if a < b:
            pieces.append((rank, place.group, a - begin, b - a, a - lo))
        begin = end
    return pieces


def _pieces3(place: Place, lengths: list[list[int]]) -> list[Piece]:
    """The pieces of a ZeRO-3 parameter: rank r holds elements [r * each, (r + 1) * each)."""
    each, pieces = -(-place.numel // len(lengths)), []
    for rank, groups in enumerate(lengths):
        starts = np.cumsum([0] + groups)
        group = int(np.searchsorted(starts, place.offset, side="right")) - 1
        count = min(each, place.numel - rank * each)
        if count > 0:
            pieces.append((rank, group, place.offset - int(starts[group]), count, rank * each))
    return pieces


def _check_fits(places: list[Place], ranks: Ranks) -> None:
    """The partitions hold every parameter's elements: a shortfall is another model's state."""
    if ranks.stage == 3:
        need = sum(-(-p.numel // ranks.world) for p in places)
        have = min(sum(g) for g in ranks.lengths)
        where = "each rank's partition"
    else:
        need = max((p.offset + p.numel for p in places), default=0)
        have = min(sum(r[g] for r in ranks.lengths) for g in range(len(ranks.lengths[0])))
        where = "the partitions"
    if need > have:
        raise CheckpointError(f"{ranks.tag}: {where} hold {have} elements but param_shapes need {need}; the "
                              "optimizer state of a different model or world size?")


# ---- import ---------------------------------------------------------------------------------------

def read_run(folder: Path, config: Optional[Path]) -> ForeignRun:
    found = locate(folder)
    if found is None:
        raise CheckpointError(f"{folder}: no DeepSpeed checkpoint here (a 'latest' file naming a folder with "
                              f"{MODEL_STATES} or {RANK_MODEL_STATES.format(0)})")
    tag = found.tag
    states_path = tag / (MODEL_STATES if (tag / MODEL_STATES).is_file() else RANK_MODEL_STATES.format(0))
    states = load(states_path, "the model states")
    mp = states.get("mp_world_size", 1)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if mp != 1 or dims.get("tp_degree", 1) != 1 or dims.get("pp_degree", 1) != 1:
        raise CheckpointError(f"{states_path}: saved with tensor or pipeline parallelism (mp_world_size {mp}, {dims}); "
                              "only data-parallel ZeRO checkpoints import: convert it with DeepSpeed's ds_to_universal "
                              "first")
    step = integer(_count(states.get("global_steps")), str(states_path), "global_steps")
    skipped = integer(_count(states.get("skipped_steps", 0)), str(states_path), "skipped_steps", 0, step)
    shapes = _shapes(_field(states, "param_shapes", states_path), states_path, "param_shapes")
    ds_config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    lp = _lp_dtype(ds_config)
    model, notes = _model(found, config, lp)
    if states.get("frozen_param_shapes"):
        raise CheckpointError(f"{states_path}: has frozen parameters ({', '.join(list(states['frozen_param_shapes'])[:3])}"
                              "); ms_llm trains every weight, so a partly frozen run does not import")
    if found.universal:
        tensors, hyper, world = _universal(found, shapes, lp, states_path)
    else:
        tensors, hyper, world = _zero(tag, shapes, lp, states_path, states)
    state, state_notes = _state(step, skipped, hyper, lp, tag)
    job, job_notes = _job(config, ds_config, model, world, states_path)
    if job is not None and "lr" in state:
        from ms_llm.job import job_from_dict
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


def _model(found: Found, config: Optional[Path], lp: str) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig of the Hugging Face config.json beside the checkpoint (or --config itself
    when it is one)."""
    candidates = [found.tag / HF_CONFIG, found.root / HF_CONFIG]
    if config is not None:
        candidates = ([config] if _is_hf_config(config) else [Path(config).parent / HF_CONFIG]) + candidates
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise CheckpointError(f"{found.tag}: no {HF_CONFIG} (the model's Hugging Face config) in {found.root} or "
                              "beside --config; DeepSpeed checkpoints hold no head count: save it with "
                              f"model.config.save_pretrained('{found.root}')")
    try:
        cfg = json.loads(read_regular(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a JSON config ({exc})") from None
    return model_from_hf_config(cfg, str(path), lp), []


def _is_hf_config(path: Path) -> bool:
    try:
        data = json.loads(read_regular(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, CheckpointError):
        return False
    return isinstance(data, dict) and "model_type" in data


def _zero(tag: Path, shapes, lp: str, states_path: Path, states: dict):
    """The tensors of a ZeRO-1/2/3 save: fp32 masters and moments out of the ranks' partitions."""
    prefix = "bf16_" if (tag / OPTIM_STATES.format("bf16_", 0)).is_file() else ""
    first = load(tag / OPTIM_STATES.format(prefix, 0), "dp rank 0's optimizer states")
    osd = _field(first, "optimizer_state_dict", tag / OPTIM_STATES.format(prefix, 0), dict)
    stage = _count(osd.get("zero_stage"))
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{tag / OPTIM_STATES.format(prefix, 0)}: 'zero_stage' is {stage!r}; ZeRO stage 1-3 "
                              "checkpoints import")
    counts = osd.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts) or len(set(counts)) > 1:
        raise CheckpointError(f"{tag / OPTIM_STATES.format(prefix, 0)}: 'partition_count' is {counts!r}; one dp size "
                              "for every group expected (expert groups do not import)")
    world = counts[0]
    if states.get("dp_world_size", world) != world:
        raise CheckpointError(f"{states_path}: dp_world_size {states.get('dp_world_size')} but the optimizer files "
                              f"say partition_count {world}")
    extra = [p.name for p in tag.glob(OPTIM_STATES.format(prefix, "*"))
             if (m := re.search(r"rank_(\d+)_mp", p.name)) and int(m.group(1)) >= world]
    if extra:
        raise CheckpointError(f"{tag / extra[0]}: a rank beyond partition_count {world}; files of two saves mixed?")
    del first, osd
    ranks = Ranks(tag, prefix, world, stage)
    ranks.open()
    if stage == 3:
        places = zero3_places(shapes, world)
        cut = _pieces3
    else:
        places = zero12_places(shapes, ranks.meta[0].get("param_alignment_paddings"))
        cut = _pieces12
    if len(shapes) != len(ranks.lengths[0]) and stage != 3:
        raise CheckpointError(f"{states_path}: {len(shapes)} parameter groups but the optimizer files hold "
                              f"{len(ranks.lengths[0])}")
    _check_fits(places, ranks)
    tensors: dict[str, LazyTensor] = {}
    for place in places:
        pieces = cut(place, ranks.lengths)

        def reader(kind: str, place: Place = place, pieces=pieces) -> Callable[[], np.ndarray]:
            return lambda: ranks.read(kind, pieces, place.numel).reshape(place.shape)
        master = LazyTensor(place.shape, "float32", reader("fp32"))
        if lp == "float32":
            tensors[place.name] = master
        else:
            tensors[optim_name("master", place.name)] = master
            tensors[place.name] = _lp_weight(place, lp, master, states_path if stage != 3 else None)
        for kind in MOMENTS:
            tensors[optim_name(kind, place.name)] = LazyTensor(place.shape, "float32", reader(kind))
    return tensors, ranks.meta[0], world


def _lp_weight(place: Place, lp: str, master: LazyTensor, states_path: Optional[Path]) -> LazyTensor:
    """The module's 16-bit weight: ZeRO-1/2 save it whole in the model states; ZeRO-3 keeps it as
    the master weights' copy in the training dtype (what its partitions are refreshed to)."""
    def read() -> np.ndarray:
        if states_path is None:
            return to_numpy(torch.from_numpy(master.read()).to(_TORCH[lp]))
        module = _field(load(states_path, "the model states"), "module", states_path, dict)
        weight = module.get(place.name)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != place.shape:
            raise CheckpointError(f"{states_path}: module weight {place.name!r} is missing or not of shape "
                                  f"{list(place.shape)}")
        return to_numpy(weight.to(_TORCH[lp]).clone())
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
                    value = _field(load(path, f"the universal checkpoint's {kind} of {folder.name}"), "param", path,
                                   torch.Tensor)
                    if tuple(value.shape) != shape:
                        raise CheckpointError(f"{path}: 'param' has shape {list(value.shape)}, param_shapes says "
                                              f"{list(shape)}; merged from tensor-parallel slices?")
                    return value.detach().float().numpy().copy()
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
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                hyper["step"] = _count(torch.load(path, map_location="cpu", weights_only=True))
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
                raise CheckpointError(f"{path}: not a readable step count ({str(exc).splitlines()[0]})") from None
    world = _count(load(states_path, "the model states").get("dp_world_size", 1))
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

