"""One optimizer step of the MindSpore worker, as the shared loop calls it: (step, rows) -> (loss, norm).

Two kinds, chosen by ms_llm.mindspore.support's ZeRO engine:
  - GraphStep: the step in two compiled graphs (TrainCell: forward and backward, then the
    update, with the checkpoint fence between them). On Ascend both run under
    semi_auto_parallel with the lowering's shard strategies (ZeRO = MindSpore's parallel
    optimizer over the AdamW moments, pp > 1 = nn.PipelineCell); on a CPU machine the same
    cells run stand-alone (one process) or DATA_PARALLEL (gradients averaged by
    DistributedGradReducer), so every line but the sharded compile runs in CI.
  - ZeroStep: the shared ZeRO engine (ms_llm.zero through ms_llm.mindspore.zero), PyNative
    around a compiled gradient function, as on torch: ZeRO 1-3 on a CPU machine.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_llm.errors import ConfigError
from ms_llm.job import JobConfig
from ms_llm.mindspore.collectives import MeanOverRanks
from ms_llm.mindspore.optim import AdamW, clip_by_norm, global_norm
from ms_llm.run import lr_at
from ms_llm.strategy.plan import ModelPlan


class ScaledLoss(nn.Cell):
    """loss * scale, so an fp16 backward keeps small gradients (scale 1 in fp32: exact). A body
    that also returns the expert loads (model.LossCell with loads) passes them through."""

    def __init__(self, body: nn.Cell):
        super().__init__(auto_prefix=False)
        self.body, self.with_loads = body, getattr(body, "with_loads", False)

    def construct(self, inputs, labels, scale):
        if self.with_loads:
            loss, loads = self.body(inputs, labels)
            return loss * scale, loads
        return self.body(inputs, labels) * scale


_store = ops.MultitypeFuncGraph("store")


@_store.register("Tensor", "Tensor")
def _store_grad(buffer, grad):
    return ops.assign(buffer, grad)


class GradCell(nn.Cell):
    """Forward and backward of one step: micro-batch gradients, data-parallel mean and unscale,
    stored in `grads`; with an expert-bias update the step's loads in `loads`. It writes those
    buffers only, never the training state, so a checkpoint snapshot may copy the state beside it.

    Inputs are stacked micro-batches (M, B, T) so the step compiles once, or the whole local
    batch (M * B, T) for nn.PipelineCell, which splits it itself. Returns the step's mean loss.

    The loss cell is a sub-cell, not only inside grad_fn: a graph loaded from MindSpore's compile
    cache binds the Parameters of its cell's parameters_dict() by name and no others, so a weight
    the cell does not list reads as uninitialised memory (NaN losses on a cached launch).
    """

    def __init__(self, body: nn.Cell, weights: ms.ParameterTuple, grads: ms.ParameterTuple, micro_batches: int,
                 reducer: Optional[nn.Cell], loss_mean: Optional[nn.Cell], pipeline: bool,
                 loads: Optional[Parameter]):
        super().__init__(auto_prefix=False)
        self.grads, self.loads, self.with_loads = grads, loads, loads is not None
        self.reducer, self.loss_mean = reducer, loss_mean
        self.micro_batches, self.pipeline = micro_batches, pipeline
        self.scaled = ScaledLoss(body)
        self.grad_fn = ms.value_and_grad(self.scaled, None, weights, has_aux=self.with_loads)
        self.hyper_map = ops.HyperMap()
        self.no_loads = Tensor(0.0, ms.float32)

    def _grad(self, inputs, labels, scale):
        """(scaled loss, gradients, expert loads; 0 without an expert-bias update) of one call."""
        if self.with_loads:
            (loss, loads), grads = self.grad_fn(inputs, labels, scale)
            return loss, grads, loads
        loss, grads = self.grad_fn(inputs, labels, scale)
        return loss, grads, self.no_loads

    def construct(self, inputs, labels, scale):
        if self.pipeline:
            loss, grads, loads = self._grad(inputs, labels, scale)
            divisor = scale
        else:
            loss, grads, loads = self._grad(inputs[0], labels[0], scale)
            for i in range(1, self.micro_batches):
                mb_loss, mb_grads, mb_loads = self._grad(inputs[i], labels[i], scale)
                loss, loads = loss + mb_loss, loads + mb_loads
                grads = tuple(g + h for g, h in zip(grads, mb_grads))
            divisor = scale * self.micro_batches
        loss = loss / divisor
        grads = tuple(g / ops.cast(divisor, g.dtype) for g in grads)
        if self.reducer is not None:          # CPU data parallel: average over dp ranks
            grads = self.reducer(grads)
            loss = self.loss_mean(loss)
        loss = ops.depend(loss, self.hyper_map(_store, self.grads, grads))      # kept: the loss depends on it
        if self.with_loads:
            loss = ops.depend(loss, ops.assign(self.loads, loads))
        return loss


class UpdateCell(nn.Cell):
    """The update of one step from GradCell's buffers: global norm, clip, AdamW, then the
    expert-bias update (moe.ExpertBiasUpdate) by the stored loads. An update whose gradient norm
    is not finite is skipped (a loss-scale overflow); the norm says so to the caller. The expert
    biases move at every step, as on torch. Returns the norm, and with an expert-bias update the
    step's loads (layers, E) after it."""

    def __init__(self, optimizer: AdamW, grads: ms.ParameterTuple, grad_clip: float,
                 expert_bias: Optional[nn.Cell], loads: Optional[Parameter]):
        super().__init__(auto_prefix=False)
        self.optimizer, self.grads, self.grad_clip = optimizer, grads, grad_clip
        self.expert_bias, self.loads, self.with_loads = expert_bias, loads, expert_bias is not None

    def construct(self, lr):
        grads = self.grads
        norm = global_norm(grads)
        if ops.isfinite(norm).all():       # the outputs depend on the update, so it runs before they return
            norm = ops.depend(norm, self.optimizer(clip_by_norm(grads, norm, self.grad_clip), lr))
        if self.with_loads:                # the loads are whole whatever the gradients (as on torch)
            return norm, self.expert_bias(self.loads)
        return norm


class TrainCell:
    """One training step as two compiled cells, GradCell (forward and backward) then UpdateCell
    (clip, AdamW, expert biases), so that the shared loop's checkpoint fence can sit between them:
    a snapshot of the last step's state copies beside the next forward and backward, which only
    read it (the torch step and ZeroStep fence at the same point). The gradients cross from one
    graph to the other in Parameters cloned from the weights, as the accumulation buffers of
    MindSpore's and MindFormers' gradient-accumulation wrappers do: under semi_auto_parallel a
    clone takes its weight's layout, as the AdamW moments do. They are named apart from those
    wrappers' accu_grads, which the pipeline pass fills by name.

    `cell(inputs, labels, scale, lr)` runs both and returns (loss, norm), and with an expert-bias
    update the step's loads after them.
    """

    def __init__(self, body: nn.Cell, optimizer: AdamW, micro_batches: int, grad_clip: float,
                 reducer: Optional[nn.Cell] = None, loss_mean: Optional[nn.Cell] = None, pipeline: bool = False,
                 expert_bias: Optional[nn.Cell] = None):
        self.optimizer, self.pipeline = optimizer, pipeline
        self.expert_bias, self.with_loads = expert_bias, expert_bias is not None
        if self.with_loads and (pipeline or not getattr(body, "with_loads", False)):
            raise ConfigError("model.moe.expert_bias: the MindSpore step updates the expert biases from the loads "
                              "its loss cell returns (model.LossCell(net, loads=True)), outside nn.PipelineCell; "
                              "use pp 1, or expert_bias false")
        weights = optimizer.parameters
        grads = weights.clone(prefix="step_grads", init="zeros")
        loads = None
        if self.with_loads:
            biases = expert_bias.biases
            loads = Parameter(Tensor(np.zeros((len(biases), biases[0].shape[0]), np.float32)), name="step_loads",
                              requires_grad=False)
        self.forward_backward = GradCell(body, weights, grads, micro_batches, reducer, loss_mean, pipeline, loads)
        self.update = UpdateCell(optimizer, grads, grad_clip, expert_bias, loads)

    def compile(self, inputs: Tensor, labels: Tensor, scale: Tensor, lr: Tensor) -> None:
        self.forward_backward.compile(inputs, labels, scale)
        self.update.compile(lr)

    def __call__(self, inputs: Tensor, labels: Tensor, scale: Tensor, lr: Tensor,
                 before_update: Callable[[], None] = lambda: None) -> tuple[Tensor, ...]:
        """The step; `before_update` runs between the two cells (the loop's checkpoint fence)."""
        loss = self.forward_backward(inputs, labels, scale)
        before_update()
        out = self.update(lr)
        return (loss, *out) if self.with_loads else (loss, out)


class EvalCell(nn.Cell):
    """Mean loss of a validation batch, forward only, in the same layout as TrainCell's inputs."""

    def __init__(self, body: nn.Cell, micro_batches: int, loss_mean: Optional[nn.Cell] = None,
                 pipeline: bool = False):
        super().__init__(auto_prefix=False)
        self.body, self.micro_batches, self.loss_mean, self.pipeline = body, micro_batches, loss_mean, pipeline

    def construct(self, inputs, labels):
        if self.pipeline:
            loss = self.body(inputs, labels)
        else:
            loss = self.body(inputs[0], labels[0])
            for i in range(1, self.micro_batches):
                loss = loss + self.body(inputs[i], labels[i])
            loss = loss / self.micro_batches
        if self.loss_mean is not None:
            loss = self.loss_mean(loss)
        return loss


class GraphStep:
    """TrainCell for the shared loop: learning rate from the schedule, loss scale from the policy.
    `buffers` are the Parameters the checkpoint keeps beside the optimizer's (the expert biases);
    `loads` the last step's expert loads (layers, E), None without an expert-bias update."""

    def __init__(self, cell: TrainCell, evaluator: EvalCell, job: JobConfig, plan: ModelPlan, loss_scale=None):
        self.cell, self.evaluator, self.train, self.loss_scale = cell, evaluator, job.train, loss_scale
        self.optimizer = cell.optimizer
        self.buffers = {p.name: p for p in cell.expert_bias.biases} if cell.with_loads else {}
        self.loads: Optional[np.ndarray] = None
        self.shape = ((-1, job.train.seq_len + 1) if cell.pipeline else
                      (plan.micro_batches, job.train.micro_batch_size, job.train.seq_len + 1))
        self.local_rows = job.train.global_batch_size // plan.strategy.dp

    def compile(self) -> None:
        """Compile before the first step: under semi_auto_parallel that slices every Parameter to
        this rank's shard, which is what a resume must fill (a checkpoint piece, not the whole)."""
        self.cell.compile(*self._inputs(np.zeros((self.local_rows, self.train.seq_len + 1), np.int32), 1.0, 0.0))

    def _inputs(self, rows: np.ndarray, scale: float, lr: float) -> tuple[Tensor, ...]:
        rows = rows.reshape(self.shape)
        return (Tensor(rows[..., :-1], ms.int32), Tensor(rows[..., 1:], ms.int32), Tensor(scale, ms.float32),
                Tensor(lr, ms.float32))

    def evaluate(self, rows: np.ndarray) -> float:
        """Global mean loss of this rank's rows of a validation batch."""
        x, y = self._inputs(rows, 1.0, 0.0)[:2]
        return float(self.evaluator(x, y).asnumpy())

    def __call__(self, step: int, rows: np.ndarray, before_update: Callable[[], None]) -> tuple[float, float]:
        """Forward and backward, then (after the fence) the update: two compiled graphs."""
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        out = self.cell(*self._inputs(rows, scale, lr_at(step, self.train)), before_update)
        if self.cell.with_loads:
            self.loads = out[2].asnumpy()
        loss, norm = float(out[0].asnumpy()), float(out[1].asnumpy().reshape(-1)[0])
        if self.loss_scale is not None:
            self.loss_scale.update(bool(np.isfinite(norm)), step + 1)
        return loss, norm


class ZeroStep:
    """ZeRO 1-3 on the shared engine (buckets, AllReduce-as-ReduceScatter, sharded AdamW, AllGather;
    under ZeRO-3 each layer gathered before use through Cell hooks)."""

    def __init__(self, net: nn.Cell, loss_cell: nn.Cell, job: JobConfig, plan: ModelPlan, rank: int, world: int):
        from ms_llm.mindspore.zero import MsZeroDataParallel
        from ms_llm.zero import zero_plan
        from ms_llm.zero.engine import EngineConfig

        self.runner = MsZeroDataParallel(loss_cell, zero_plan(plan), rank, EngineConfig.from_job(plan.strategy, job.train),
                                         net=net)
        self.buffers: dict = {}               # none: the expert biases move in GraphStep only (support.py refuses
                                              # model.moe.expert_bias here); the routed experts train here, over edp
        self.loads: Optional[np.ndarray] = None
        self.mean = MeanOverRanks(world)
        self.train, self.shape = job.train, (plan.micro_batches, job.train.micro_batch_size, job.train.seq_len + 1)

    def __call__(self, step: int, rows: np.ndarray, before_update: Callable[[], None]) -> tuple[float, float]:
        """Forward and backward of each micro-batch, then (after the fence) the engine's update."""
        rows = rows.reshape(self.shape)
        n, total = len(rows), 0.0
        for i, micro in enumerate(rows):
            x, y = Tensor(micro[:, :-1], ms.int32), Tensor(micro[:, 1:], ms.int32)
            if i < n - 1:
                with self.runner.no_sync():          # reduce once, after the last micro-batch
                    loss = self.runner.backward(x, y, scale=1.0 / n)
            else:
                loss = self.runner.backward(x, y, scale=1.0 / n)
            total += float(loss.asnumpy())
        before_update()
        norm = self.runner.step(lr_at(step, self.train))
        loss = float(self.mean(Tensor([total], ms.float32)).asnumpy()[0])
        return loss, float("nan") if norm is None else norm

    def evaluate(self, rows: np.ndarray) -> float:
        """Global mean loss of this rank's rows of a validation batch (ZeRO-3 gathers each unit
        through the same forward hooks as in training)."""
        rows = rows.reshape(self.shape)
        total = sum(float(self.runner.loss_cell(Tensor(m[:, :-1], ms.int32), Tensor(m[:, 1:], ms.int32)).asnumpy())
                    for m in rows)
        return float(self.mean(Tensor([total / len(rows)], ms.float32)).asnumpy()[0])
