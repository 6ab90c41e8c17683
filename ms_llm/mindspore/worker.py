"""One msrun worker of `ms-llm train --backend mindspore` on CPU: data parallel (+ ZeRO 1-3).

    msrun --worker_num=N ... python -m ms_llm.mindspore.worker --config RUN/config.yaml --run-dir RUN --tokens F

Every rank builds the same model from the seed (then takes rank 0's by Broadcast) and reads
its rows of the shared global batch (GlobalBatchSampler: the batch at step k is the same for
any dp size). Without ZeRO a step is one GRAPH-mode graph: micro-batch gradients, AllReduce
mean (DATA_PARALLEL), clipping, AdamW. With ZeRO 1-3 the shared engine (ms_llm.zero through
ms_llm.mindspore.zero) owns reduction, clipping and the sharded update, in PyNative mode
around a compiled gradient function, as on torch. Rank 0 writes the progress lines and
metrics.jsonl the torch backend writes.
"""
from __future__ import annotations

import time

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

from ms_llm.checkpoint.trainer import TrainerCheckpoints
from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.mindspore.collectives import BroadcastParams, MeanOverRanks
from ms_llm.mindspore.launch import worker_args
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.resume import MsTrainerState
from ms_llm.mindspore.train_step import TrainStep
from ms_llm.run import MetricsLogger, StepRate, lr_at, peak_rss_gb
from ms_llm.strategy.plan import plan


class GraphStep:
    """ZeRO off: the whole step in one GRAPH-mode graph."""

    def __init__(self, job, p, world: int):
        net = Transformer(job.model)
        net.init_weights(job.train.seed)
        loss_cell = LossCell(net)
        params = loss_cell.trainable_params()
        if world > 1:
            BroadcastParams(params)().asnumpy()
        reducer = nn.DistributedGradReducer(params, mean=True, degree=world) if world > 1 else None
        mean = MeanOverRanks(world) if world > 1 else None
        self.cell = TrainStep(loss_cell, AdamW(params, job.train.optimizer), p.micro_batches,
                              job.train.optimizer.grad_clip, reducer, mean)

    def __call__(self, rows: np.ndarray, lr: float) -> tuple[float, float]:
        loss, norm = self.cell(ms.Tensor(rows[:, :, :-1], ms.int32), ms.Tensor(rows[:, :, 1:], ms.int32),
                               ms.Tensor(lr, ms.float32))
        return float(loss.asnumpy()), float(norm.asnumpy())


class ZeroStep:
    """ZeRO 1-3: the shared engine (buckets, AllReduce-as-ReduceScatter, sharded AdamW, AllGather;
    under ZeRO-3 each layer gathered before use through Cell hooks)."""

    def __init__(self, job, p, rank: int, world: int):
        from ms_llm.mindspore.zero import MsZeroDataParallel
        from ms_llm.zero import zero_plan
        from ms_llm.zero.engine import EngineConfig

        net = Transformer(job.model)
        net.init_weights(job.train.seed)
        self.runner = MsZeroDataParallel(LossCell(net), zero_plan(p), rank,
                                         EngineConfig.from_job(p.strategy, job.train), net=net)
        self.mean = MeanOverRanks(world)

    def __call__(self, rows: np.ndarray, lr: float) -> tuple[float, float]:
        n, total = len(rows), 0.0
        for i, micro in enumerate(rows):
            x, y = ms.Tensor(micro[:, :-1], ms.int32), ms.Tensor(micro[:, 1:], ms.int32)
            if i < n - 1:
                with self.runner.no_sync():          # reduce once, after the last micro-batch
                    loss = self.runner.backward(x, y, scale=1.0 / n)
            else:
                loss = self.runner.backward(x, y, scale=1.0 / n)
            total += float(loss.asnumpy())
        norm = self.runner.step(lr)
        loss = float(self.mean(ms.Tensor([total], ms.float32)).asnumpy()[0])
        return loss, float("nan") if norm is None else norm


def main(argv: list[str] | None = None) -> int:
    job, run, tokens = worker_args(argv, __doc__.splitlines()[0])
    zero = job.strategy.zero.stage > 0
    ms.set_context(mode=ms.PYNATIVE_MODE if zero else ms.GRAPH_MODE, device_target="CPU")
    init()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    p = plan(job.model, job.strategy, job.train, world)
    train, dp = job.train, p.strategy.dp
    dp_rank = p.mesh.index_in("dp", rank)

    step_fn = ZeroStep(job, p, rank, world) if zero else GraphStep(job, p, world)
    sampler = GlobalBatchSampler(load_tokens(tokens, train.data.token_dtype), train.seq_len,
                                 train.global_batch_size, train.seed)
    logger = MetricsLogger(run.metrics if rank == 0 else None, train.steps, train.log_every)
    rate = StepRate.of(job, world)
    mode = "DATA_PARALLEL, PyNative + shared ZeRO engine" if zero else "DATA_PARALLEL, GRAPH"
    logger.event(event="start", backend="mindspore", mode=mode, world_size=world, dp=dp, zero_stage=p.zero.stage,
                 micro_batches=p.micro_batches)

    checkpoints = TrainerCheckpoints(job, run, p, MsTrainerState(step_fn, p, rank, world), sampler, rank, logger)
    for step in range(checkpoints.resume(), train.steps):
        rows = sampler.local_batch(step, dp_rank, dp)                      # (G/dp, T+1)
        rows = rows.reshape(p.micro_batches, train.micro_batch_size, train.seq_len + 1)
        lr = lr_at(step, train)
        start = time.perf_counter()
        loss, gnorm = step_fn(rows, lr)                                   # host floats: the step is done
        elapsed = time.perf_counter() - start
        logger.log(rate.metrics(step + 1, loss, lr, elapsed, peak_rss_gb(), gnorm))
        if not np.isfinite(loss):
            logger.event(event="diverged", step=step + 1)
            logger.close()
            return 3
        checkpoints.after_step(step + 1, elapsed)
    checkpoints.close()
    logger.event(event="done", steps=train.steps)
    logger.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
