"""MindSpore side of ms_llm checkpoints: Parameters <-> numpy, and MindSpore's own format.

Live training (the format, writer and reader are ms_llm.checkpoint, shared with torch):

    items = save_items(param_pieces(plan, rank), {p.name: p for p in net.get_parameters()})
    writer.save(step, items, ...)
    load_into(Checkpoint.open(root, rank), param_pieces(plan, rank), params)

Interchange with MindSpore's tools: `export_mindspore` writes rank_<r>/<prefix><r>.ckpt plus
strategy/rank_<r>.ckpt (protobuf strategy files, strategy_file.py) that transform_checkpoints,
merge_sliced_parameter and load_distributed_checkpoint accept; `import_mindspore` reads
such per-rank checkpoints back. Adam moments are MindSpore's adam_m.<param> / adam_v.<param>.
Use output_format="ckpt" with transform_checkpoints: its safetensors output writes wrong values
for column-split parameters in MindSpore 2.10.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import mindspore as ms
import numpy as np

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.shards import Piece, layout_piece
from ms_llm.checkpoint.storage.format import optim_name, split_optim_name
from ms_llm.checkpoint.storage.safetensors_io import bf16_to_f32, dtype_name, f32_to_bf16
from ms_llm.checkpoint.storage.untrusted import confined
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem, held_items
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError
from ms_llm.mindspore.lower import parallel_optimizer_plan
from ms_llm.mindspore.strategy_file import MsParamLayout, ms_param_layout, read_strategy_file, to_layout, \
    write_strategy_file
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import ModelPlan

# ms_llm optimizer-state name <-> MindSpore Adam / AdamWeightDecay parameter prefix.
MS_STATE = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}
MS_STATE_BACK = {v: k for k, v in MS_STATE.items()}


def to_numpy(t) -> tuple[np.ndarray, str]:
    """Host numpy of a MindSpore Tensor/Parameter and its checkpoint dtype (bfloat16 as bits)."""
    if t.dtype == ms.bfloat16:
        return f32_to_bf16(t.astype(ms.float32).asnumpy()), "bfloat16"
    array = t.asnumpy()
    return array, dtype_name(array)


def from_numpy(array: np.ndarray, dtype: str) -> ms.Tensor:
    """A Tensor over the array's own memory (ms.Tensor(array) would copy it first); bfloat16
    bits are widened to float32 and cast back."""
    if dtype == "bfloat16":
        return ms.Tensor.from_numpy(bf16_to_f32(array)).astype(ms.bfloat16)
    return ms.Tensor.from_numpy(np.ascontiguousarray(array))


def save_items(pieces: dict[str, Piece], params: dict) -> list[SaveItem]:
    """SaveItems for every piece (writer.held_items); `params` maps the same names to local Parameters."""
    return held_items(pieces, params, lambda piece, param: SaveItem(piece, *to_numpy(param)))


def load_into(ckpt: Checkpoint, pieces: dict[str, Piece], params: dict, strict: bool = True) -> list[str]:
    """Set each Parameter from its piece (dtype converted to the Parameter's). Returns names."""
    arrays = ckpt.read_pieces(pieces, strict=strict)
    for name, array in arrays.items():
        param = params[name]
        value = from_numpy(array, ckpt.entry(name).dtype)
        if tuple(param.shape) != tuple(value.shape):
            raise CheckpointError(f"{name}: Parameter {tuple(param.shape)} but the piece read is {tuple(value.shape)}")
        if value.dtype != param.dtype:
            value = value.astype(param.dtype)
        param[:] = value                            # in place: compiled graphs holding it see the values
    return sorted(arrays)


# ---- MindSpore's per-rank checkpoints + strategy files --------------------------------------
def export_mindspore(src: str | Path, out: str | Path, target: ModelPlan, *, zero_shards: bool = True,
                     prefix: str = "checkpoint_") -> Path:
    """Write checkpoint `src` as MindSpore per-rank .ckpt files and strategy files for `target`.
    With zero_shards, optimizer states (and ZeRO-3 weights) are written as the slices MindSpore's
    parallel optimizer holds on each rank (lower.parallel_optimizer_plan)."""
    target = parallel_optimizer_plan(target)
    ckpt = Checkpoint.open(src)
    out = Path(out)
    (out / "strategy").mkdir(parents=True, exist_ok=True)
    states = sorted({o[0] for n in ckpt.names() if (o := split_optim_name(n))} & set(MS_STATE))
    for rank in range(target.world_size):
        stage = target.mesh.coords(rank)["pp"]
        srank = target.stage_rank(rank)
        entries: dict[str, MsParamLayout] = {}
        saved = []
        for p in target.params_of_stage(stage):
            tensors = [(p.name, p.name, p.stored_layout)]
            tensors += [(optim_name(s, p.name), f"{MS_STATE[s]}.{p.name}", p.optimizer_layout) for s in states]
            for ours, theirs, layout in tensors:
                if ours not in ckpt.index.tensors:
                    raise CheckpointError(f"{ckpt.folder}: lacks {ours!r}, which the target plan holds")
                entry, held = ms_param_layout(p.layout, layout if zero_shards else None)
                entries[theirs] = entry
                array = ckpt.read(ours, layout_piece(ours, held, srank))
                saved.append({"name": theirs, "data": from_numpy(array, ckpt.entry(ours).dtype)})
        (out / f"rank_{rank}").mkdir(exist_ok=True)
        ms.save_checkpoint(saved, str(confined(out, f"rank_{rank}/{prefix}{rank}.ckpt", "an export file")))
        write_strategy_file(confined(out, f"strategy/rank_{rank}.ckpt", "an export file"), entries, stage,
                            {n: e.dev_matrix for n, e in entries.items()})
    ckpt.close()
    return out


def rank_checkpoint(folder: Path, rank: int) -> Path:
    """The .ckpt of rank_<rank>/ that MindSpore's tools would pick (last in name order)."""
    files = sorted((folder / f"rank_{rank}").glob("*.ckpt"))
    if not files:
        raise CheckpointError(f"{folder / f'rank_{rank}'}: no .ckpt file")
    return confined(folder, f"rank_{rank}/{files[-1].name}", f"the checkpoint of rank {rank}")


def rank_layouts(strategy: Path, rank: int, stage_devices: Optional[int] = None) -> dict[str, MsParamLayout]:
    """Layouts that apply to `rank`: strategy/rank_<r>.ckpt when `strategy` is a folder of
    per-rank files, else one file for all ranks (a merged pipeline file's '<stage>-' prefixes
    are resolved with the rank's stage)."""
    path = confined(strategy, f"rank_{rank}.ckpt", "a per-rank strategy file") if strategy.is_dir() else strategy
    entries, _ = read_strategy_file(path)
    if entries and all("-" in n and n.split("-", 1)[0].isdigit() for n in entries):
        devices = stage_devices or int(np.prod(next(iter(entries.values())).dev_matrix))
        if devices < 1:
            raise CheckpointError(f"{path}: device matrix of {devices} devices; a strategy file needs at least 1")
        stage = rank // devices
        entries = {n.split("-", 1)[1]: e for n, e in entries.items() if n.split("-", 1)[0] == str(stage)}
    return entries


def import_mindspore(folder: str | Path, strategy: str | Path, dst_root: str | Path, model: ModelConfig,
                     step: int = 0) -> Path:
    """Write MindSpore per-rank checkpoints (folder/rank_<r>/*.ckpt) with their strategy file(s)
    as an ms_llm checkpoint: every rank's slices become shards at the boxes the strategy gives,
    so any layout loads it. Parameters the strategy does not mention (learning rate, global
    step, ...) are not model state and are left out."""
    folder, strategy = Path(folder), Path(strategy)
    ranks = sorted(int(p.name[5:]) for p in folder.glob("rank_*") if p.name[5:].isascii() and p.name[5:].isdigit())
    if not ranks or ranks != list(range(len(ranks))):
        raise CheckpointError(f"{folder}: expected rank_0 ... rank_N-1 folders, found {ranks}")
    shapes = {n: p.shape for n, p in layout_plan(model, ParallelStrategy(dp=1), 1).params.items()}
    owner: dict[tuple, int] = {}                          # (name, box) -> lowest rank holding it
    pieces: dict[int, dict[str, Piece]] = {}
    for rank in ranks:
        pieces[rank] = {}
        for theirs, entry in rank_layouts(strategy, rank).items():
            ours = _our_name(theirs)
            owned = split_optim_name(ours)
            param = owned[1] if owned else ours
            if param not in shapes:
                continue
            layout = to_layout(shapes[param], entry)
            piece = layout_piece(ours, layout, rank % layout.mesh.size)
            first = owner.setdefault((ours, piece.region.offsets), rank)
            pieces[rank][theirs] = Piece(ours, piece.shape, piece.region, first == rank, piece.layout)
    config = {"backend": "mindspore", "model": to_dict(model, full=True), "world_size": len(ranks)}
    for rank in reversed(ranks):                          # rank 0 last: it commits
        params = ms.load_checkpoint(str(rank_checkpoint(folder, rank)))
        items = []
        for theirs, piece in pieces[rank].items():
            if not piece.primary:                         # held here, saved by another rank
                items.append(SaveItem(piece, None))
                continue
            if theirs not in params:
                raise CheckpointError(f"{rank_checkpoint(folder, rank)}: lacks {theirs!r}, which the strategy lists")
            array, dtype = to_numpy(params[theirs])
            if array.shape != piece.local_shape:
                raise CheckpointError(f"{rank_checkpoint(folder, rank)}: {theirs!r} is {array.shape} but the "
                                      f"strategy gives rank {rank} a {piece.local_shape} slice")
            items.append(SaveItem(piece, array, dtype))
        writer = CheckpointWriter(dst_root, rank, len(ranks), session=f"ms-import-{step}")
        writer.save(step, items, config=config)
        writer.close()
    return Path(dst_root)


def _our_name(theirs: str) -> Optional[str]:
    head, _, rest = theirs.partition(".")
    return optim_name(MS_STATE_BACK[head], rest) if head in MS_STATE_BACK else theirs
