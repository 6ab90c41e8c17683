"""The training loop of one worker: plan, lower, then step, log, repeat."""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ms_llm.checkpoint.trainer import TrainerCheckpoints
from ms_llm.config.job import JobConfig, dump_yaml, job_to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.data import GlobalBatchSampler, build_stdlib_corpus, load_tokens
from ms_llm.run import MetricsLogger, RunFolder, StepMetrics, StepRate, lr_at, peak_rss_gb
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.resume import TorchTrainerState
from torch_backend.step import TrainStep


def token_stream(train: TrainConfig, run: RunFolder) -> np.ndarray:
    """The shared corpus: built once per node (local rank 0) into the run folder, then mapped."""
    if train.data.source != "stdlib":
        return load_tokens(train.data.source, train.data.token_dtype)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        build_stdlib_corpus(run.data)
    dist.barrier()
    return load_tokens(build_stdlib_corpus(run.data))     # cached by now: returns the path


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


def train(job: JobConfig, run: RunFolder, device: torch.device) -> list[StepMetrics]:
    rank, world = dist.get_rank(), dist.get_world_size()
    tc = job.train
    plan = make_plan(job.model, job.strategy, tc, world)
    if rank == 0:
        run.config.write_text(dump_yaml(job_to_dict(dataclasses.replace(job, strategy=plan.strategy))))

    # Lower the plan: mesh, pipeline chunks, TP/SP, AC, compile, DP/ZeRO (torch_backend/parallelize).
    meshes = build_meshes(plan.mesh, device.type)
    lowered = lower(plan, meshes, device, rank, compile=tc.compile)
    step_fn = TrainStep(lowered)
    if rank == 0:
        print(f"lowered: {plan.mesh.describe()} | data parallel: {lowered.dp.name} (ZeRO {plan.zero.stage}) | "
              f"{plan.micro_batches} micro-batch(es) | precision {plan.strategy.precision.compute_dtype} | "
              f"device {device}", flush=True)

    # Data: the global batch of step k is fixed; this dp rank reads its rows of it.
    sampler = GlobalBatchSampler(token_stream(tc, run), tc.seq_len, tc.global_batch_size, tc.seed)
    dp_rank, dp_size = meshes.coord("dp"), meshes.size("dp")

    logger = MetricsLogger(run.metrics if rank == 0 else None, tc.steps, tc.log_every)
    rate = StepRate.of(job, world)
    history = []
    checkpoints = TrainerCheckpoints(job, run, plan, TorchTrainerState(step_fn, plan, rank), sampler, rank, logger)
    for step in range(checkpoints.resume(), tc.steps):
        t0 = time.perf_counter()
        batch = torch.from_numpy(sampler.local_batch(step, dp_rank, dp_size))    # (B_local, T + 1)
        loss, grad_norm = step_fn(step, batch)
        loss, grad_norm = loss.item(), grad_norm.item()                        # waits for the step
        dt = time.perf_counter() - t0
        m = rate.metrics(step + 1, loss, lr_at(step, tc), dt, memory_gb(device), grad_norm)
        logger.log(m, force=step == 0)
        history.append(m)
        checkpoints.after_step(step + 1, dt)
    checkpoints.close()
    logger.close()
    return history
