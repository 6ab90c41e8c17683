"""The training loop every worker runs, whatever the backend.

A backend builds its model and hands over a Trainer: the resolved job and plan, a step
function `(step, rows) -> (loss, grad_norm)` that runs one optimizer step on this rank's
rows of the global batch and returns host floats, and a TrainerState that lists its tensors
for the shared checkpoint code. Everything else is here, once: resume, the data order, the
learning-rate schedule (inside the step, from ms_llm.run.lr), metrics, the checkpoint cadence,
the divergence stop, the heartbeat and shutdown.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from ms_llm.data import BatchSampler, GlobalBatchSampler, load_tokens, samples
from ms_llm.errors import ConfigError, TrainingDiverged
from ms_llm.job import JobConfig
from ms_llm.run.checkpoints import TrainerCheckpoints, TrainerState
from ms_llm.run.folder import RunFolder
from ms_llm.run.heartbeat import Heartbeat
from ms_llm.run.loss_scale import LossScaler
from ms_llm.run.lr import lr_at
from ms_llm.run.metrics import MetricsLogger, StepMetrics, StepRate
from ms_llm.strategy.plan import ModelPlan

DIVERGED_EXIT = 3        # a worker's exit status after a divergence stop: restarting would repeat it


class StepFunction(Protocol):
    def __call__(self, step: int, rows: np.ndarray, before_update: Callable[[], None]) -> tuple[float, float]:
        """One optimizer step on rows (B_local, T + 1) of the global batch of `step` (0-based);
        returns (global mean loss, global gradient norm) once the step is done. The step calls
        `before_update` before it writes to any tensor of the training state (an
        asynchronous save may still be copying them), as late as it can."""


@dataclass
class Trainer:
    """What a backend hands the loop."""
    job: JobConfig                       # resolved by the launcher (run/config.yaml)
    run: RunFolder
    plan: ModelPlan
    rank: int
    step: StepFunction
    state: TrainerState
    memory_gb: Callable[[], float]       # peak device (or host) memory of this rank
    logs: bool                           # this rank prints progress and writes metrics.jsonl
    loss_scale: Optional[LossScaler] = None   # fp16: a non-finite norm is a skipped step, not divergence
    evaluate: Optional[Callable[[np.ndarray], float]] = None   # rows (B_local, T + 1) -> global mean loss
    reported: Callable[[], dict[str, float]] = dict     # the last step's figures beside the loss (mtp_loss, ...)


def token_sampler(job: JobConfig, run: RunFolder) -> BatchSampler:
    """The shared data order: indexed datasets through the sample order the launcher built in
    the run folder, else the token file it resolved train.data.source to."""
    t = job.train
    if t.data.paths:
        return samples.train_sampler(t, run.data)
    if t.data.source == "stdlib":
        raise ConfigError(f"{run.config}: train.data.source is 'stdlib'; workers read the token file the launcher "
                          "resolves it to: start them with `ms-llm train`")
    return GlobalBatchSampler(load_tokens(t.data.source, t.data.token_dtype), t.seq_len, t.global_batch_size, t.seed)


def validation_rows(job: JobConfig, run: RunFolder, dp_rank: int, dp: int) -> list[np.ndarray]:
    """This rank's rows of each fixed validation batch (empty when train.eval is off)."""
    t = job.train
    if t.eval.interval == 0:
        return []
    if not t.data.paths:
        raise ConfigError("train.eval.interval: validation needs train.data.paths (indexed datasets with a valid "
                          "share in train.data.split); set train.eval.interval: 0 or give data paths")
    valid = samples.valid_batches(t, run.data)
    if valid is None:
        raise ConfigError(f"train.eval: the valid split holds less than one global batch of {t.global_batch_size}; "
                          "give it a larger share in train.data.split or set train.eval.interval: 0")
    per_rank = t.global_batch_size // dp
    return [rows[dp_rank * per_rank:(dp_rank + 1) * per_rank] for rows in valid.batches(t.eval.batches)]


def check_finite(step: int, loss: float, grad_norm: float, norm_measured: bool, skipped: bool,
                 saved: Optional[int]) -> None:
    """Stop on a non-finite loss, or a non-finite gradient norm that no loss scale explains
    (engines that do not clip may not measure the norm: it is NaN then)."""
    if math.isfinite(loss) and (math.isfinite(grad_norm) or skipped or not norm_measured):
        return
    kept = f"the last checkpoint, step {saved}, is kept" if saved else "no checkpoint was saved before it"
    raise TrainingDiverged(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; {kept}. "
                           "Lower train.optimizer.lr, raise warmup or grad_clip, and resume from that checkpoint")


def train(t: Trainer) -> list[StepMetrics]:
    tc = t.job.train
    dp_rank = t.plan.mesh.index_in("dp", t.rank)          # which rows of each global batch this rank reads
    sampler = token_sampler(t.job, t.run)
    logger = MetricsLogger(t.run.metrics if t.logs else None, tc.steps, tc.log_every)
    rate = StepRate.of(t.job, t.plan.world_size)
    heartbeat = Heartbeat(t.run.heartbeat, t.rank)
    norm_measured = tc.optimizer.grad_clip > 0 or t.loss_scale is not None
    valid = validation_rows(t.job, t.run, dp_rank, t.plan.strategy.dp) if t.evaluate is not None else []
    checkpoints = TrainerCheckpoints(t.job, t.run, t.plan, t.state, sampler, t.rank, logger, t.loss_scale)
    history: list[StepMetrics] = []
    done = 0                                              # steps completed, for a failure record
    try:
        heartbeat.beat(0, phase="resume")                 # alive: the supervisor times startup from here
        first = done = checkpoints.resume()
        heartbeat.beat(first, phase="start")
        if first >= tc.steps and t.logs:
            print(f"run complete: {t.run.root} holds step {first} of train.steps = {tc.steps}; raise --steps "
                  "to train further", flush=True)
        for step in range(first, tc.steps):
            rows = sampler.local_batch(step, dp_rank, t.plan.strategy.dp)         # (B_local, T + 1)
            scale = t.loss_scale.scale if t.loss_scale is not None else None      # the scale this step uses
            start = time.perf_counter()
            loss, grad_norm = t.step(step, rows, checkpoints.fence)                # host floats: the step is done
            elapsed = time.perf_counter() - start
            done = step + 1
            heartbeat.beat(done)
            m = rate.metrics(step + 1, loss, lr_at(step, tc), elapsed, t.memory_gb(), grad_norm)
            skipped = scale is not None and not math.isfinite(grad_norm)
            if scale is not None:
                m.extra["loss_scale"] = scale
            m.extra.update(t.reported())
            if valid and ((step + 1) % tc.eval.interval == 0 or step + 1 == tc.steps):
                m.extra["val_loss"] = sum(t.evaluate(rows) for rows in valid) / len(valid)
            logger.log(m, force=step == first)
            check_finite(step + 1, loss, grad_norm, norm_measured, skipped, checkpoints.last_step)
            history.append(m)
            checkpoints.after_step(step + 1, elapsed)
        checkpoints.close()
        heartbeat.beat(tc.steps, phase="done")
        logger.event(event="done", steps=tc.steps)
    except TrainingDiverged as exc:
        checkpoints.close()                   # the pending save is of a good step: let it commit
        logger.event(event="diverged", error=str(exc))
        heartbeat.fail(done, exc)
        raise
    except Exception as exc:                  # what failed and why, for the supervisor's classification
        heartbeat.fail(done, exc)
        raise
    finally:
        logger.close()
    return history
