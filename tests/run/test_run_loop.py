"""The shared training loop's own logic (ms_llm/run/loop.py), framework-free: data order, metrics,
heartbeat, the divergence stop, and a loss-scale skip that is not divergence. The workers that
run it on real models are tested in test_ms_worker.py, test_torch_train.py and test_ms_train.py."""
import math

import numpy as np
import pytest

from ms_llm.data import GlobalBatchSampler
from ms_llm.errors import ConfigError, TrainingDiverged
from ms_llm.job import job_from_dict
from ms_llm.run import RunFolder
from ms_llm.run.heartbeat import read_heartbeats
from ms_llm.run.loop import Trainer, check_finite, train
from ms_llm.run.loss_scale import LossScaler
from ms_llm.run.metrics import read_metrics
from ms_llm.strategy.plan import plan

MODEL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 64,
         "max_seq_len": 16}


def make(tmp_path, losses, grad_clip=1.0, **strategy):
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 64, 4000, dtype=np.uint16).tofile(tokens)
    job = job_from_dict({"name": "loop", "model": MODEL, "strategy": {"dp": 1} | strategy,
                         "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": len(losses),
                                   "data": {"source": str(tokens)}, "optimizer": {"grad_clip": grad_clip}}})
    seen = []

    def step(i, rows, before_update):
        before_update()
        seen.append((i, rows.copy()))
        return losses[i]

    run = RunFolder.create("loop", tmp_path / "run")
    return Trainer(job, run, plan(job.model, job.strategy, job.train, 1), 0, step, state=None, memory_gb=lambda: 0.5, logs=True), seen


def test_steps_read_the_shared_global_batches_and_log_them(tmp_path):
    trainer, seen = make(tmp_path, [(3.0, 1.0), (2.5, 0.9), (2.0, 0.8)])
    history = train(trainer)
    tc = trainer.job.train
    sampler = GlobalBatchSampler(np.fromfile(tc.data.source, np.uint16), tc.seq_len, tc.global_batch_size, tc.seed)
    assert [i for i, _ in seen] == [0, 1, 2]
    assert all((rows == sampler.local_batch(i, 0, 1)).all() for i, rows in seen)
    assert [m.loss for m in history] == [3.0, 2.5, 2.0]
    records = read_metrics(trainer.run.metrics)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3] and records[-1]["event"] == "done"
    beat = read_heartbeats(trainer.run.heartbeat)[0]
    assert beat["step"] == 3 and beat["phase"] == "done"


def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    trainer, seen = make(tmp_path, [(3.0, 1.0), (float("nan"), 1.0), (2.0, 1.0)])
    with pytest.raises(TrainingDiverged, match="diverged at step 2: loss nan.*no checkpoint was saved"):
        train(trainer)
    assert len(seen) == 2                                  # step 3 never ran
    assert read_metrics(trainer.run.metrics)[-1]["event"] == "diverged"
    assert read_heartbeats(trainer.run.heartbeat)[0]["step"] == 2


def test_a_non_finite_norm_is_divergence_unless_a_loss_scale_skipped_the_step(tmp_path):
    trainer, _ = make(tmp_path, [(3.0, float("inf")), (2.0, 1.0)])
    with pytest.raises(TrainingDiverged, match="step 1: loss 3.0, gradient norm inf"):
        train(trainer)
    scaled, _ = make(tmp_path / "scaled", [(3.0, float("inf")), (2.0, 1.0)])
    scaled.loss_scale = LossScaler("dynamic", 1024.0)
    assert len(train(scaled)) == 2
    # Engines that do not clip need not measure the norm.
    check_finite(1, 3.0, math.nan, norm_measured=False, skipped=False, saved=None)
    with pytest.raises(TrainingDiverged, match="the last checkpoint, step 10, is kept"):
        check_finite(11, math.inf, 1.0, norm_measured=True, skipped=False, saved=10)


def test_an_unresolved_token_source_is_refused(tmp_path):
    trainer, _ = make(tmp_path, [(1.0, 1.0)])
    job = job_from_dict({"model": MODEL, "train": {"global_batch_size": 2, "micro_batch_size": 2, "seq_len": 16}})
    with pytest.raises(ConfigError, match="start them with `ms-llm train`"):
        train(Trainer(job, trainer.run, plan(job.model, job.strategy, job.train, 1), 0, None, None, lambda: 0.0, True))
