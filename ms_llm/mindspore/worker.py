"""One msrun worker of `ms-llm train --backend mindspore` on CPU: data parallel (+ ZeRO 1/2).

    msrun --worker_num=N ... python -m ms_llm.mindspore.worker --config RUN/config.yaml --run-dir RUN --tokens F

Every rank builds the same model from the seed, reads its rows of the shared global batch
(GlobalBatchSampler: the batch at step k is the same for any dp size), and runs one compiled
graph per step: micro-batch gradients, AllReduce mean (DATA_PARALLEL), clipping, AdamW with
ZeRO shards. Rank 0 writes the progress lines and metrics.jsonl the torch backend writes.
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

from ms_llm.checkpoint.trainer import TrainerCheckpoints
from ms_llm.config.job import load_job
from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.mindspore.collectives import MeanOverRanks, zero_shards
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.resume import MsTrainerState
from ms_llm.mindspore.train_step import TrainStep
from ms_llm.run import MetricsLogger, RunFolder, StepMetrics, lr_at
from ms_llm.strategy.devices import get_device
from ms_llm.strategy.plan import plan


def build_step(job, p, rank: int, world: int) -> TrainStep:
    net = Transformer(job.model)
    net.init_weights(job.train.seed)
    loss_cell = LossCell(net)
    params = loss_cell.trainable_params()
    shards = zero_shards(p, [q.name for q in params], rank)
    optimizer = AdamW(params, job.train.optimizer, shards)
    reducer = nn.DistributedGradReducer(params, mean=True, degree=world) if world > 1 else None
    mean = MeanOverRanks(world) if world > 1 else None
    step = TrainStep(loss_cell, optimizer, p.micro_batches, job.train.optimizer.grad_clip, reducer, mean)
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--tokens", required=True)
    args = ap.parse_args(argv)

    job = load_job(args.config)
    run = RunFolder(Path(args.run_dir))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    p = plan(job.model, job.strategy, job.train, world)
    train, dp = job.train, p.strategy.dp
    dp_rank = p.mesh.index_in("dp", rank)

    step_cell = build_step(job, p, rank, world)
    sampler = GlobalBatchSampler(load_tokens(Path(args.tokens), train.data.token_dtype), train.seq_len,
                                 train.global_batch_size, train.seed)
    logger = MetricsLogger(run.metrics if rank == 0 else None, train.steps, train.log_every)
    device = get_device(job.device)
    tokens_per_step = train.global_batch_size * train.seq_len
    flops_per_step = job.model.flops_per_token(train.seq_len) * tokens_per_step
    logger.event(event="start", backend="mindspore", mode="DATA_PARALLEL/GRAPH/CPU", world_size=world,
                 dp=dp, zero_stage=p.zero.stage, micro_batches=p.micro_batches)

    checkpoints = TrainerCheckpoints(job, run, p, MsTrainerState(step_cell, p, rank, world), sampler, rank, logger)
    for step in range(checkpoints.resume(), train.steps):
        rows = sampler.local_batch(step, dp_rank, dp)                      # (G/dp, T+1)
        rows = rows.reshape(p.micro_batches, train.micro_batch_size, train.seq_len + 1)
        lr = lr_at(step, train)
        start = time.perf_counter()
        loss, gnorm = step_cell(ms.Tensor(rows[:, :, :-1], ms.int32), ms.Tensor(rows[:, :, 1:], ms.int32),
                                ms.Tensor(lr, ms.float32))
        loss, gnorm = float(loss.asnumpy()), float(gnorm.asnumpy())       # waits for the step to finish
        elapsed = time.perf_counter() - start
        logger.log(StepMetrics(
            step=step + 1, loss=loss, lr=lr, tokens_per_s=tokens_per_step / elapsed,
            mfu=flops_per_step / elapsed / (device.peak_flops * world),
            memory_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, grad_norm=gnorm,
            step_time_s=elapsed))
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
