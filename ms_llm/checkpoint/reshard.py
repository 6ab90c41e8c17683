"""Offline resharding: rewrite a checkpoint for another strategy and world size.

Online resharding needs none of this (every rank reads its pieces straight from any
checkpoint); this is for handing a checkpoint to a job that wants its own layout on disk,
or for writing a world-size-1 (full tensor) checkpoint that exports start from.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.shards import Piece, optim_pieces, param_pieces
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.storage.commit import step_dir
from ms_llm.checkpoint.storage.format import run_config, split_optim_name
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem
from ms_llm.config.model import ModelConfig
from ms_llm.config.train import TrainConfig
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import ModelPlan, plan


def layout_plan(model: ModelConfig, strategy: ParallelStrategy, world_size: Optional[int] = None) -> ModelPlan:
    """A ModelPlan for tensor layouts only: the batch and sequence length (which layouts do
    not depend on) are picked so that batch and sequence rules pass."""
    s = strategy.resolve(world_size)
    micro = 2 * s.pp
    seq = 2 * s.cp * s.tp
    seq *= max(1, min(model.max_seq_len, 128) // seq)
    train = TrainConfig(global_batch_size=s.dp * micro, micro_batch_size=1, seq_len=seq)
    strategy = dataclasses.replace(strategy, pipeline=dataclasses.replace(strategy.pipeline, micro_batches=-1))
    return plan(model, strategy, train, world_size)


def rank_pieces(ckpt: Checkpoint, target: ModelPlan, rank: int) -> dict[str, Piece]:
    """What `rank` of `target` holds of every tensor in `ckpt`: model weights and optimizer
    states by the plan; tensors the plan does not know (extra state) whole, on rank 0."""
    states = sorted({o[0] for n in ckpt.names() if (o := split_optim_name(n))})
    pieces = param_pieces(target, rank) | optim_pieces(target, rank, states)
    pieces = {n: p for n, p in pieces.items() if n in ckpt.index.tensors}
    for name in ckpt.names():
        owned = split_optim_name(name)
        if name not in target.params and not (owned and owned[1] in target.params) and rank == 0:
            shape = ckpt.entry(name).shape
            pieces[name] = Piece(name, shape, Region((0,) * len(shape), shape))
    return pieces


def reshard(src: str | Path | Checkpoint, dst_root: str | Path, target: ModelPlan, backend: str = "",
            keep_last: int = 3) -> Path:
    """Write `src` (a checkpoint folder or root, or an opened source such as hf.hf_source)
    under `dst_root` laid out for `target`."""
    ckpt = src if isinstance(src, Checkpoint) else Checkpoint.open(src)
    world = target.world_size
    for rank in reversed(range(world)):            # rank 0 last: it commits once all are written
        writer = CheckpointWriter(dst_root, rank, world, session=f"reshard-{ckpt.step}", keep_last=keep_last)
        pieces = rank_pieces(ckpt, target, rank)
        items = [SaveItem(p, ckpt.read(n, p), ckpt.entry(n).dtype) for n, p in pieces.items() if p.primary]
        writer.save(ckpt.step, items, state=ckpt.state, rank_state=ckpt.rank_state(rank),
                    config=run_config(target, backend or ckpt.config.get("backend", "")))
        writer.close()
    ckpt.close()
    return step_dir(Path(dst_root), ckpt.step)


def write_full(arrays: dict[str, tuple[np.ndarray, str]], dst_root: str | Path, model: ModelConfig, *,
               step: int = 0, backend: str = "", state: Optional[dict] = None) -> Path:
    """A one-rank checkpoint of whole tensors {name: (array, dtype)} (what importers write)."""
    target = layout_plan(model, ParallelStrategy(dp=1), 1)
    items = [SaveItem(Piece(n, a.shape, Region((0,) * a.ndim, a.shape)), a, d) for n, (a, d) in arrays.items()]
    writer = CheckpointWriter(dst_root, 0, 1, session=f"import-{step}")
    writer.save(step, items, state=state, config=run_config(target, backend))
    writer.close()
    return step_dir(Path(dst_root), step)
