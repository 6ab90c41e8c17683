"""The MindSpore trainer's training state for ms_llm.run.checkpoints (save cadence, resume).

Two step kinds (ms_llm/mindspore/step.py): GraphStep, whose AdamW holds moments next to the
weights, each rank the piece its layout gives it (whole on a CPU machine; the shard the
lowering gives it under semi_auto_parallel on Ascend, where ZeRO is MindSpore's parallel optimizer
and its split lower.parallel_optimizer_plan's); and ZeroStep, the shared engine, whose
flat segments ms_llm.checkpoint.zero_state cuts into pieces. Engine segments are replaced by
each (functional) update, so a slice is looked up when it is used.

A GraphStep's Parameters are copied into a save's snapshot on the writer's threads, beside the
next forward and backward (the step fences before its update); on Ascend the device-to-host copy
is there too, as torch_backend's copies are, not on the training thread.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_llm.checkpoint import layout_piece, optim_name, optim_pieces, param_pieces
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage.safetensors_io import DTYPES
from ms_llm.checkpoint.writer import SaveItem, held_items
from ms_llm.checkpoint.zero_state import EngineSlice, engine_slices
from ms_llm.errors import CheckpointError
from ms_llm.mindspore.checkpoint import load_into, save_items, to_numpy
from ms_llm.mindspore.lower import parallel_optimizer_plan
from ms_llm.run.checkpoints import Held
from ms_llm.strategy.plan import ModelPlan

STATES = ("exp_avg", "exp_avg_sq")
AGREE_WIDTH = 4             # values per agreement row: the most any caller compares at once
# MindSpore dtype -> our checkpoint dtype name (bfloat16 apart: it is widened by a cast).
DTYPE_NAMES = {getattr(ms, "bool_" if name == "bool" else name): name for name in DTYPES if name != "bfloat16"}


class _Gather(nn.Cell):
    """AllGather over all ranks (MindSpore's CPU AllReduce sums only; a max needs the values)."""

    def __init__(self):
        super().__init__()
        self.all_gather = ops.AllGather()

    def construct(self, x):
        return self.all_gather(x)


def agreement_row(values: list[float]) -> np.ndarray:
    """`values` as one float32 row of AGREE_WIDTH, zero-padded: every agreement a resume makes
    (folder counts, load failures, steps, the session token) gathers the same shape, so the
    AllGather graph compiles once per launch, not once per value count and dtype (each new shape
    was one more graph compilation in every recovery: 70-90 ms each on a CPU)."""
    if len(values) > AGREE_WIDTH:
        raise ValueError(f"{len(values)} values to agree on; an agreement row holds {AGREE_WIDTH}")
    row = np.zeros((1, AGREE_WIDTH), np.float32)
    row[0, :len(values)] = values
    return row


class SegmentSlice:
    """A piece of an engine segment with the Parameter surface the checkpoint adapter uses
    (shape, dtype, astype, asnumpy to save; item assignment to load, in place)."""

    def __init__(self, engine, where: EngineSlice):
        self.engine, self.where = engine, where
        self.shape = where.piece.local_shape

    def _flat(self) -> Tensor:
        return getattr(self.engine.state[self.where.bucket], self.where.attr)

    @property
    def dtype(self):
        return self._flat().dtype

    def _value(self) -> Tensor:
        s = self.where
        return self._flat()[s.start:s.start + s.numel].reshape(self.shape)

    def astype(self, dtype) -> Tensor:
        return self._value().astype(dtype)

    def asnumpy(self):
        return self._value().asnumpy()

    def __setitem__(self, index, value: Tensor) -> None:
        s = self.where
        self._flat()[s.start:s.start + s.numel] = value.reshape(-1).astype(self.dtype)


def _copier(param) -> Callable[[np.ndarray], None]:
    """Fills the snapshot's buffer from `param` when the writer's thread runs it."""
    def copy(dst: np.ndarray) -> None:
        np.copyto(dst, param.asnumpy())
    return copy


def _graph_item(piece: Piece, param) -> SaveItem:
    """A GraphStep Parameter's item: copied on the writer's threads; bfloat16 (widened by a
    MindSpore cast) here."""
    if param.dtype == ms.bfloat16:
        return SaveItem(piece, *to_numpy(param))
    if tuple(param.shape) != piece.local_shape:
        raise CheckpointError(f"{piece.name}: Parameter {tuple(param.shape)} does not match its planned piece "
                              f"{piece.local_shape}; the model was not laid out by this plan")
    if param.dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{piece.name}: dtype {param.dtype} cannot be checkpointed")
    return SaveItem(piece, _copier(param), DTYPE_NAMES[param.dtype])


class MsTrainerState:
    """ms_llm.run.checkpoints.TrainerState over a GraphStep or a ZeroStep."""
    backend = "mindspore"
    load_into = staticmethod(load_into)

    def __init__(self, step_fn, plan: ModelPlan, rank: int, world: int):
        self.step_fn, self.plan, self.rank, self.world = step_fn, plan, rank, world
        self._gather = _Gather() if world > 1 else None
        self._engine = getattr(getattr(step_fn, "runner", None), "engine", None)

    def held(self, create: bool) -> Held:
        if self._engine is None:
            return dict(self._graph_held)
        out = {n: (s.piece, SegmentSlice(self._engine, s))
               for n, s in engine_slices(self._engine, self.plan, self.rank).items()}
        weights = {p.name: p for p in self.step_fn.runner.weights}
        for name, piece in param_pieces(self.plan, self.rank).items():
            if name not in out:                 # ZeRO-3 shards are already in, from the engine
                out[name] = (piece, weights[name])
        out.update(self._buffers())
        return out

    @functools.cached_property
    def _graph_held(self) -> Held:
        """A GraphStep's state: the same Parameters at every save, so the plan is cut into pieces
        once (each save would spend about 15 ms of Python on a 75-tensor model doing it again).
        Its ZeRO is MindSpore's parallel optimizer, whose split is lower.parallel_optimizer_plan's."""
        opt, plan = self.step_fn.optimizer, parallel_optimizer_plan(self.plan)
        weights = {p.name: p for p in opt.parameters}
        out = self._optimizer(opt, plan)
        out.update({name: (piece, weights[name]) for name, piece in param_pieces(plan, self.rank).items()})
        out.update(self._buffers())
        return out

    def save_items(self, pieces: dict[str, Piece], tensors: dict) -> list[SaveItem]:
        """A GraphStep's Parameters as copy functions (_graph_item); an engine's slices, cut by
        PyNative ops, as host arrays taken here on the training thread."""
        if self._engine is None:
            return held_items(pieces, tensors, _graph_item)
        return save_items(pieces, tensors)

    def _buffers(self) -> Held:
        """The plan's buffers of this rank's stage (the expert biases), whole and equal on every
        rank, from the step's Parameters outside the optimizer."""
        stage, srank = self.plan.mesh.coords(self.rank)["pp"], self.plan.stage_rank(self.rank)
        held = {}
        for name, b in self.plan.buffers.items():
            if b.stage == stage:
                if name not in self.step_fn.buffers:
                    raise CheckpointError(f"{name}: the plan keeps this buffer but the MindSpore model holds no "
                                          "such Parameter; model and plan disagree")
                held[name] = (layout_piece(name, b.layout, srank), self.step_fn.buffers[name])
        return held

    def _optimizer(self, opt, plan: ModelPlan) -> Held:
        states, out = optim_pieces(plan, self.rank, STATES), {}
        for i, p in enumerate(opt.parameters):
            for state, tensors in zip(STATES, (opt.exp_avg, opt.exp_avg_sq)):
                name = optim_name(state, p.name)
                piece, t = states[name], tensors[i]
                if tuple(t.shape) != piece.local_shape:
                    raise CheckpointError(f"{name}: the optimizer holds {tuple(t.shape)} where the plan puts a "
                                          f"{piece.local_shape} piece; optimizer and plan disagree")
                out[name] = (piece, t)
        return out

    def max_over_ranks(self, values: list[float]) -> list[float]:
        if self._gather is None:
            return list(values)
        every = self._gather(ms.Tensor.from_numpy(agreement_row(values))).asnumpy()     # (world, AGREE_WIDTH)
        return [float(x) for x in every.max(axis=0)[:len(values)]]

    def session_token(self) -> str:
        """Rank 0's random draw, the same on every rank and new for every launch (a relaunch on
        several nodes reuses msrun's scheduler address and port): four 16-bit draws, each exact
        in the float32 agreement row."""
        mine = np.frombuffer(os.urandom(2 * AGREE_WIDTH), np.uint16)
        if self._gather is None:
            return mine.tobytes().hex()
        every = self._gather(ms.Tensor.from_numpy(agreement_row(mine.tolist()))).asnumpy()
        return every[0].astype(np.uint16).tobytes().hex()

    def set_optimizer_step(self, steps: int) -> None:
        if self._engine is not None:
            self._engine.step_count = steps
        else:
            self.step_fn.optimizer.set_step(steps)

    def rank_state(self) -> dict:
        return {}                       # the model draws no random numbers while training

    def set_rank_state(self, state: dict) -> None:
        return None
