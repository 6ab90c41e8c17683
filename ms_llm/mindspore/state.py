"""The MindSpore trainer's training state for ms_llm.run.checkpoints (save cadence, resume).

Two step kinds (ms_llm/mindspore/step.py): GraphStep, whose AdamW holds moments next to the
weights, each rank the piece its layout gives it (whole on a CPU machine; the shard the
lowering gives it under semi_auto_parallel on Ascend); and ZeroStep, the shared engine, whose
flat segments ms_llm.checkpoint.zero_state cuts into pieces. Engine segments are replaced by
each (functional) update, so a slice is looked up when it is used.
"""
from __future__ import annotations

import os

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_llm.checkpoint import layout_piece, optim_name, optim_pieces, param_pieces
from ms_llm.checkpoint.zero_state import EngineSlice, engine_slices
from ms_llm.errors import CheckpointError
from ms_llm.mindspore.checkpoint import load_into, save_items
from ms_llm.run.checkpoints import Held
from ms_llm.strategy.plan import ModelPlan

STATES = ("exp_avg", "exp_avg_sq")
AGREE_WIDTH = 4             # values per agreement row: the most any caller compares at once


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


class MsTrainerState:
    """ms_llm.run.checkpoints.TrainerState over a GraphStep or a ZeroStep."""
    backend = "mindspore"
    save_items = staticmethod(save_items)
    load_into = staticmethod(load_into)

    def __init__(self, step_fn, plan: ModelPlan, rank: int, world: int):
        self.step_fn, self.plan, self.rank, self.world = step_fn, plan, rank, world
        self._gather = _Gather() if world > 1 else None

    def held(self, create: bool) -> Held:
        engine = getattr(getattr(self.step_fn, "runner", None), "engine", None)
        if engine is not None:
            out = {n: (s.piece, SegmentSlice(engine, s)) for n, s in engine_slices(engine, self.plan, self.rank).items()}
            weights = {p.name: p for p in self.step_fn.runner.weights}
        else:
            opt = self.step_fn.optimizer
            weights = {p.name: p for p in opt.parameters}
            out = self._optimizer(opt)
        for name, piece in param_pieces(self.plan, self.rank).items():
            if name not in out:                 # ZeRO-3 shards are already in, from the engine
                out[name] = (piece, weights[name])
        out.update(self._buffers())
        return out

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

    def _optimizer(self, opt) -> Held:
        states, out = optim_pieces(self.plan, self.rank, STATES), {}
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
        engine = getattr(getattr(self.step_fn, "runner", None), "engine", None)
        if engine is not None:
            engine.step_count = steps
        else:
            self.step_fn.optimizer.set_step(steps)

    def rank_state(self) -> dict:
        return {}                       # the model draws no random numbers while training

    def set_rank_state(self, state: dict) -> None:
        return None
