"""DeepSpeed's checkpoint files, read safely: where a save lies, what torch.load(weights_only=True)
may build of its pickles, and where each parameter lies in the dp ranks' flat partitions.

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

Files are read with torch.load(weights_only=True, mmap=True), each once (Mapped): DeepSpeed's loss
scaler and fragment records become inert stand-ins (_Peer) holding their attributes, never DeepSpeed's
classes, and a parameter's pieces are copied out of the mapped ranks one parameter at a time.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from ms_llm.checkpoint.storage.untrusted import confined, open_regular
from ms_llm.errors import CheckpointError
from torch_backend.checkpoint import to_numpy

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"                      # ZeRO-0/1/2
RANK_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # ZeRO-3, one per dp rank
OPTIM_STATES = "{}zero_pp_rank_{}_mp_rank_00_optim_states.pt"      # prefix "bf16_" under bf16
MOMENTS = ("exp_avg", "exp_avg_sq")
HF_CONFIG = "config.json"
CHUNK = 1 << 22                      # elements copied under one mapping of a file (16 MB of fp32)


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


def load(path: Path, what: str, kind: type | tuple = dict) -> Any:
    """One DeepSpeed file through torch.load(weights_only=True, mmap=True): tensors stay in the
    mapped file until sliced. Every failure is one line naming the file."""
    try:
        fd, _ = open_regular(path)          # a FIFO or a folder is refused before torch opens it
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: {what}") from None
    os.close(fd)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        reason = f"it names {named.group(1)}" if named else (str(exc).strip().splitlines() or ["?"])[0]
        raise CheckpointError(f"{path}: torch.load(weights_only=True) refuses it ({reason}); ms_llm runs no code "
                              "from a checkpoint") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a whole torch file, truncated? ({first})") from None
    if not isinstance(data, kind):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not DeepSpeed's states ({what})")
    return data


class Mapped:
    """One DeepSpeed file loaded once (its pickle parsed once; its tensors stay in the mapped file).
    A tensor is copied out CHUNK elements at a time and each chunk's pages are dropped from this
    process as soon as it is copied (madvise DONTNEED: they stay in the page cache), since a mapped
    page otherwise stays resident for as long as the mapping, and reading a whole file through
    one mapping would hold it all."""

    def __init__(self, path: Path, what: str, kind: type | tuple = dict):
        self.path, self.what = path, what
        self.data = load(path, what, kind)
        self.span = _file_span(path)

    def copy(self, pick: Callable[[Any], torch.Tensor], start: int, out: np.ndarray) -> None:
        """Elements [start, start + out.size) of the flat tensor `pick` takes from the file's data,
        into `out` (fp32, float16, or bfloat16 bits as uint16)."""
        dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(np.uint16): torch.bfloat16}[out.dtype]
        flat = pick(self.data).detach().reshape(-1)
        if flat.numel() < start + out.size:
            raise CheckpointError(f"{self.path}: a tensor of {flat.numel()} elements where {start + out.size} are "
                                  "needed")
        for lo in range(0, out.size, CHUNK):
            hi = min(out.size, lo + CHUNK)
            piece = flat[start + lo:start + hi]
            out[lo:hi] = to_numpy(piece.to(dtype))
            self._release(piece)

    def _release(self, piece: torch.Tensor) -> None:
        """Drop the pages under `piece` from this process; only pages of this file's own mapping
        (clean, read-only use: a later touch reads them from the file again)."""
        if self.span is None:
            return
        page = mmap.PAGESIZE
        lo = max(self.span[0], piece.data_ptr() // page * page)
        hi = min(self.span[1], -(-(piece.data_ptr() + piece.nbytes) // page) * page)
        if lo < hi:
            _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


_LIBC = ctypes.CDLL(None, use_errno=True)


def _file_span(path: Path) -> Optional[tuple[int, int]]:
    """The addresses of `path`'s mapping in this process (/proc/self/maps), None if not found."""
    real, spans = os.path.realpath(path), []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    lo, hi = fields[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return None
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def field(data: Any, keys: str, path: Path, kind: type | tuple = object) -> Any:
    """data[k1][k2]... of a loaded file, of type `kind`; else one line naming the file and field."""
    value = data
    for key in keys.split("."):
        if not isinstance(value, dict) or key not in value:
            raise CheckpointError(f"{path}: lacks '{keys}'; not a DeepSpeed checkpoint file of this kind?")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CheckpointError(f"{path}: '{keys}' is a {type(value).__name__}; expected {kind}")
    return value


def count(value: Any) -> Any:
    """A step count as DeepSpeed stores it: int, or a 0-d tensor (torch's Adam)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


# ---- where the checkpoint is ----------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    """The folder of one save, `tag`, holding the rank files (or a ds_to_universal folder), in the
    folder the user named, `root` (the tag itself, or the folder whose `latest` names it)."""
    root: Path
    tag: Path
    universal: bool


def tag_file(root: Path, name: str) -> Optional[Path]:
    """The folder a `latest` pointer names, confined to `root`."""
    pointer = root / name
    if not pointer.is_file():
        return None
    fd, _ = open_regular(pointer)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(4096).decode("utf-8", "replace").strip()
    return confined(root, raw, f"'{name}' (the tag of the newest save)")


def locate(folder: Path) -> Optional[Found]:
    """A DeepSpeed save from file names only: the folder itself, or the one `latest` (else
    `latest_universal`) names."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for tag in (folder, tag_file(folder, LATEST), tag_file(folder, LATEST_UNIVERSAL)):
        if tag is None or not tag.is_dir():
            continue
        if (tag / MODEL_STATES).is_file() or (tag / RANK_MODEL_STATES.format(0)).is_file():
            return Found(folder, tag, (tag / "zero").is_dir())
    return None


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


def param_shapes(groups: Any, path: Path, field: str) -> list[list[tuple[str, tuple[int, ...]]]]:
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
        self.files: list[Mapped] = []                # rank's file, loaded once

    def path(self, rank: int) -> Path:
        return self.tag / OPTIM_STATES.format(self.prefix, rank)

    def flats(self, data: dict, rank: int, kind: str) -> list[torch.Tensor]:
        """Rank `rank`'s flat tensors of `kind` ("fp32" or a moment), one per group."""
        path, osd = self.path(rank), field(data, "optimizer_state_dict", self.path(rank), dict)
        if kind == "fp32":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            flats = field(osd, key, path, list)
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
            self.files.append(Mapped(self.path(rank), f"the optimizer states of dp rank {rank}; the save was made "
                                     f"by {self.world} dp ranks (partition_count) and each rank's file is needed"))
            data = self.files[-1].data
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
                              **hyper(osd.get("optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"))})
        groups = {len(g) for g in self.lengths}
        if len(groups) != 1:
            raise CheckpointError(f"{self.tag}: the ranks hold different numbers of parameter groups")

    def places(self, shapes: list[list[tuple[str, tuple[int, ...]]]], where: Path) -> list[tuple[Place, list[Piece]]]:
        """Each parameter of param_shapes with its pieces in the ranks' partitions, checked to fit."""
        if self.stage == 3:
            places, cut = zero3_places(shapes, self.world), pieces3
        else:
            if len(shapes) != len(self.lengths[0]):
                raise CheckpointError(f"{where}: {len(shapes)} parameter groups but the optimizer files hold "
                                      f"{len(self.lengths[0])}")
            places, cut = zero12_places(shapes, self.meta[0].get("param_alignment_paddings")), pieces12
        check_fits(places, self)
        return [(place, cut(place, self.lengths)) for place in places]

    def read(self, kind: str, pieces: list[Piece], total: int) -> np.ndarray:
        """One parameter's `kind` as an fp32 array of `total` elements from its pieces: elements
        [start, start + count) of rank `rank`'s flat `group`, laid at `at`."""
        out = np.empty(total, np.float32)
        for rank, group, start, count, at in pieces:
            self.files[rank].copy(lambda data, rank=rank, group=group: self.flats(data, rank, kind)[group], start,
                                  out[at:at + count])
        return out


def hyper(base: Any) -> dict:
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
    steps = [count(s.get("step")) for s in states if isinstance(s, dict) and "step" in s]
    if not steps and out.get("groups"):
        steps = [count(out["groups"][0].get("step"))]
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


def pieces12(place: Place, lengths: list[list[int]]) -> list[Piece]:
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


def pieces3(place: Place, lengths: list[list[int]]) -> list[Piece]:
    """The pieces of a ZeRO-3 parameter: rank r holds elements [r * each, (r + 1) * each)."""
    each, pieces = -(-place.numel // len(lengths)), []
    for rank, groups in enumerate(lengths):
        starts = np.cumsum([0] + groups)
        group = int(np.searchsorted(starts, place.offset, side="right")) - 1
        count = min(each, place.numel - rank * each)
        if count > 0:
            pieces.append((rank, group, place.offset - int(starts[group]), count, rank * each))
    return pieces


def check_fits(places: list[Place], ranks: Ranks) -> None:
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


def open_ranks(tag: Path, states: dict, states_path: Path) -> Ranks:
    """The ranks' optimizer files of a save, checked: the stage, one dp size (partition_count), a
    file for each rank and none beyond."""
    prefix = "bf16_" if (tag / OPTIM_STATES.format("bf16_", 0)).is_file() else ""
    path = tag / OPTIM_STATES.format(prefix, 0)
    osd = field(load(path, "the optimizer states of dp rank 0"), "optimizer_state_dict", path, dict)
    stage = count(osd.get("zero_stage"))
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{path}: 'zero_stage' is {stage!r}; ZeRO stage 1-3 checkpoints import")
    counts = osd.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or len(set(counts)) > 1 or any(not isinstance(c, int) or isinstance(c, bool) or c < 1
                                                 for c in counts):
        raise CheckpointError(f"{path}: 'partition_count' is {counts!r}; one dp size for every group expected "
                              "(expert groups do not import)")
    world = counts[0]
    if states.get("dp_world_size", world) != world:
        raise CheckpointError(f"{states_path}: dp_world_size {states.get('dp_world_size')} but the optimizer files "
                              f"say partition_count {world}")
    extra = [p.name for p in tag.glob(OPTIM_STATES.format(prefix, "*"))
             if (m := re.search(r"rank_(\d+)_mp", p.name)) and int(m.group(1)) >= world]
    if extra:
        raise CheckpointError(f"{tag / extra[0]}: a rank beyond partition_count {world}; files of two saves mixed?")
    ranks = Ranks(tag, prefix, world, stage)
    ranks.open()
    return ranks
