"""One msrun worker on Ascend: the plan lowered to semi_auto_parallel and trained by MindSpore.

    msrun --worker_num=N ... python -m ms_llm.mindspore.auto_worker --config RUN/config.yaml --run-dir RUN --tokens F

The lowering sets the auto-parallel context (pipeline stages, parallel optimizer for ZeRO,
dataset strategy, strategy checkpoint file), every primitive's shard strategy, each cell's
pipeline stage and recompute. MindSpore's parallel optimizer shards only nn.Optimizer
subclasses, so this path uses nn.AdamWeightDecay (no bias correction: its early steps
differ from torch's AdamW; the CPU runtime's optim.AdamW matches torch exactly) without
gradient clipping. MindSpore compiles this graph only on Ascend (or GPU); on CPU the cell
is built and checked up to compilation (tests/test_ms_auto_worker.py).
"""
from __future__ import annotations

import time

import numpy as np
import mindspore as ms
from mindspore import nn

from ms_llm.config.job import JobConfig
from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.mindspore.apply import apply_lowering, set_context
from ms_llm.mindspore.launch import worker_args
from ms_llm.mindspore.lower import Lowering, lower
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.run import MetricsLogger, StepRate, lr_at
from ms_llm.strategy.plan import ModelPlan, plan

DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16}


def build_train_cell(job: JobConfig, low: Lowering) -> nn.Cell:
    """The whole training step under the lowering (set the context first: cells read it)."""
    p, train = low.plan, job.train
    net = Transformer(job.model)
    net.init_weights(train.seed)
    loss_cell = apply_lowering(LossCell(net), low)
    compute = DTYPES[p.strategy.precision.compute_dtype]
    if compute != ms.float32:
        net.to_float(compute)
        loss_cell.loss.to_float(ms.float32)            # softmax cross-entropy in fp32
    if p.strategy.pp > 1:
        body = nn.PipelineCell(loss_cell, micro_size=p.micro_batches)
    elif p.micro_batches > 1:
        body = nn.GradAccumulationCell(loss_cell, micro_size=p.micro_batches)
    else:
        body = loss_cell
    opt = train.optimizer
    lrs = ms.Tensor(np.array([lr_at(s, train) for s in range(max(1, train.steps))], np.float32))
    optimizer = nn.AdamWeightDecay(loss_cell.trainable_params(), learning_rate=lrs, beta1=opt.beta1,
                                   beta2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay)
    return nn.TrainOneStepCell(body, optimizer)


def logging_rank(p: ModelPlan) -> int:
    """The first rank of the last pipeline stage: it holds the loss."""
    return p.mesh.rank(pp=p.strategy.pp - 1)


def main(argv: list[str] | None = None) -> int:
    job, run, tokens = worker_args(argv, __doc__.splitlines()[0])
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.GRAPH_MODE)
    init()
    rank, world = get_rank(), get_group_size()
    p = plan(job.model, job.strategy, job.train, world)
    low = lower(p, strategy_file=str(run.root / "strategy" / f"ckpt_strategy_rank_{rank}.ckpt"))
    set_context(low)
    step_cell = build_train_cell(job, low)

    train = job.train
    dp_rank = p.mesh.index_in("dp", rank)
    sampler = GlobalBatchSampler(load_tokens(tokens, train.data.token_dtype), train.seq_len,
                                 train.global_batch_size, train.seed)
    logger = MetricsLogger(run.metrics if rank == logging_rank(p) else None, train.steps, train.log_every)
    rate = StepRate.of(job, world)
    for step in range(train.steps):
        rows = sampler.local_batch(step, dp_rank, p.strategy.dp)          # this dp rank's whole sequences
        start = time.perf_counter()
        loss = float(step_cell(ms.Tensor(rows[:, :-1], ms.int32), ms.Tensor(rows[:, 1:], ms.int32)).asnumpy())
        elapsed = time.perf_counter() - start
        logger.log(rate.metrics(step + 1, loss, lr_at(step, train), elapsed, memory_gb=0.0))
    logger.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
