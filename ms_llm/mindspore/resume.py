"""The MindSpore trainer's training state for ms_llm.checkpoint.trainer (save cadence, resume).

The CPU data-parallel worker keeps full weights on every rank and, with ZeRO, each rank's
shard of the AdamW moments (the plan's optimizer layout), so its pieces are the plan's.
"""
from __future__ import annotations

import os
from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from ms_llm.checkpoint import optim_name, optim_pieces, param_pieces
from ms_llm.checkpoint.trainer import Held
from ms_llm.errors import CheckpointError
from ms_llm.mindspore.checkpoint import load_into, save_items
from ms_llm.mindspore.train_step import TrainStep
from ms_llm.strategy.plan import ModelPlan

STATES = ("exp_avg", "exp_avg_sq")


class _Gather(nn.Cell):
    """AllGather over all ranks (MindSpore's CPU AllReduce sums only; a max needs the values)."""

    def __init__(self):
        super().__init__()
        self.all_gather = ops.AllGather()

    def construct(self, x):
        return self.all_gather(x)


class MsTrainerState:
    """ms_llm.checkpoint.trainer.TrainerState over the worker's TrainStep cell."""
    backend = "mindspore"

    def __init__(self, step_cell: Optional[TrainStep], plan: ModelPlan, rank: int, world: int):
        """`step_cell` None: a subclass holds the optimizer states (ms_llm.mindspore.zero)."""
        self.optimizer = step_cell.optimizer if step_cell is not None else None
        self.plan, self.rank, self.world = plan, rank, world
        self._gather = _Gather() if world > 1 else None

    def held(self, create: bool) -> Held:
        opt = self.optimizer
        weights = {p.name: p for p in opt.params}
        out = {n: (piece, weights[n]) for n, piece in param_pieces(self.plan, self.rank).items()}
        states = optim_pieces(self.plan, self.rank, STATES)
        for i, p in enumerate(opt.params):
            for state, tensors in zip(STATES, (opt.exp_avg, opt.exp_avg_sq)):
                name = optim_name(state, p.name)
                piece, t = states[name], tensors[i]
                if tuple(t.shape) != piece.local_shape:
                    raise CheckpointError(f"{name}: the optimizer holds {tuple(t.shape)} where the plan puts a "
                                          f"{piece.local_shape} piece; optimizer and plan disagree")
                out[name] = (piece, t)
        return out

    save_items = staticmethod(save_items)
    load_into = staticmethod(load_into)

    def max_over_ranks(self, values: list[float]) -> list[float]:
        if self._gather is None:
            return list(values)
        every = self._gather(ms.Tensor([values], ms.float32)).asnumpy()      # (world, len(values))
        return [float(x) for x in every.max(axis=0)]

    def session_token(self) -> str:
        """msrun gives every worker of one launch the same scheduler address and port."""
        return f"ms-{os.environ.get('MS_SCHED_HOST', '')}-{os.environ.get('MS_SCHED_PORT', '')}"

    def set_optimizer_step(self, steps: int) -> None:
        self.optimizer.step.set_data(ms.Tensor(float(steps), ms.float32))

    def rank_state(self) -> dict:
        return {}                       # the model draws no random numbers while training

    def set_rank_state(self, state: dict) -> None:
        return None
