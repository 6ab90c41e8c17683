"""The MindSpore worker (the one that runs on Ascend) at world 1, stand-alone on CPU: the same
TrainCell, AdamW (nn.Optimizer) and clipping that semi_auto_parallel compiles on Ascend.

- 5 AdamW steps with clipping engaged follow the torch single-process reference within 1e-5;
- a run started from its step-3 checkpoint repeats steps 4-5 exactly;
- fp16 compute with dynamic loss scaling stays finite and close to fp32;
- tiny_moe follows the torch backend, and its checkpoints cross backends and expert splits.

Each of those starts a worker (a MindSpore compile): `make test` runs them, `make test-fast` does not.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ms_llm.data import load_tokens
from ms_llm.job import job_from_dict
from ms_llm.run.metrics import read_metrics
from test_ms_train import FP32, JOB, torch_reference

pytestmark = pytest.mark.mindspore
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(0).integers(0, 320, 40_000, dtype=np.uint16).tofile(path)
    return path


def run_worker(run: Path, job: dict) -> list[dict]:
    """Write the resolved job as `ms-llm train` does, start one worker, return its step records.
    The worker gets the launcher's compile cache folder: a later run of the same graphs (a resume:
    steps and checkpoints are host-only) loads them from the suite's shared cache, not compiling."""
    from ms_llm.mindspore.compile_cache import RUN_ENV, job_cache
    from ms_llm.run import RunFolder

    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, **{RUN_ENV: str(job_cache(RunFolder(run), 1))})
    proc = subprocess.run([sys.executable, "-m", "ms_llm.mindspore.worker", "--run-dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def job_dict(tokens: Path, **strategy) -> dict:
    job = JOB | {"backend": "mindspore", "strategy": {"dp": 1, "precision": FP32} | strategy}
    job["train"] = job["train"] | {"data": {"source": str(tokens)}, "checkpoint": {"interval": 3},
                                   "optimizer": JOB["train"]["optimizer"] | {"grad_clip": 0.5}}
    return job


@pytest.fixture(scope="module")
def fp32_run(tokens, tmp_path_factory):
    run = tmp_path_factory.mktemp("fp32")
    return run, run_worker(run, job_dict(tokens))


@pytest.mark.slow
def test_world_1_follows_the_torch_reference_with_clipping(fp32_run, tokens):
    _, records = fp32_run
    losses = [r["loss"] for r in records]
    reference = torch_reference(job_from_dict(job_dict(tokens)), load_tokens(tokens))
    assert len(losses) == 5
    assert np.abs(np.array(losses) - np.array(reference)).max() <= 1e-5, (losses, reference)
    assert min(r["grad_norm"] for r in records) > 0.5            # grad_clip 0.5 engaged at every step
    assert records[-1]["memory_gb"] > 0


@pytest.mark.slow
def test_resume_from_step_3_repeats_steps_4_and_5(fp32_run, tokens, tmp_path):
    run, records = fp32_run
    job = job_dict(tokens)
    job["train"]["checkpoint"] = {"interval": 3, "load": str(run / "checkpoints" / "step_00000003")}
    resumed = run_worker(tmp_path / "resumed", job)
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in records[3:]]



def test_every_resume_agreement_gathers_one_row_shape():
    """A resume agrees on folder counts (2 values), load failures (1), the step loaded (2), the
    session token (4 draws) and, for an auto interval, 4 timings: one float32 row for all, so
    the AllGather compiles once per launch; the values come back exactly."""
    from ms_llm.mindspore.state import AGREE_WIDTH, agreement_row
    asked = [[3.0, -3.0], [0.0], [1200.0, -1200.0], [65535.0, 0.0, 17.0, 1.0], [0.01, 2.5, 0.2, 0.03]]
    rows = [agreement_row(v) for v in asked]
    assert {(r.shape, r.dtype) for r in rows} == {((1, AGREE_WIDTH), np.dtype(np.float32))}
    for values, row in zip(asked, rows):
        assert row[0, :len(values)].tolist() == np.float32(values).tolist()
        assert not row[0, len(values):].any()
    with pytest.raises(ValueError, match="holds 4"):
        agreement_row([0.0] * (AGREE_WIDTH + 1))
@pytest.mark.slow
def test_fp16_with_dynamic_loss_scaling_is_finite_and_close_to_fp32(fp32_run, tokens, tmp_path):
    _, records = fp32_run
    fp16 = {"param_dtype": "float32", "compute_dtype": "float16", "loss_scale": "dynamic"}
    half = run_worker(tmp_path / "fp16", job_dict(tokens, precision=fp16))
    losses = np.array([r["loss"] for r in half])
    assert len(losses) == 5 and np.isfinite(losses).all()
    assert all(r["loss_scale"] == 65536.0 for r in half)          # no overflow: the scale held
    assert np.abs(losses - np.array([r["loss"] for r in records])).max() <= 1e-3      # measured: 1.4e-4


def _torch_train(job: dict, run: Path) -> list[dict]:
    config = run.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(job | {"backend": "torch"}))
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_tiny_moe_follows_the_torch_backend_with_router_losses(tokens, tmp_path):
    """tiny_moe (load-balancing and z losses on) at world 1: the loss MindSpore reports and trains
    on (cross-entropy + router losses, their gradient through the loss) is torch's TrainStep's."""
    job = job_dict(tokens)
    job["model"] = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
    job["model"]["moe"] |= {"aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}
    job["train"] = job["train"] | {"steps": 3, "checkpoint": {"interval": 0}}
    ours = run_worker(tmp_path / "ms", job)
    torch_losses = [r["loss"] for r in _torch_train(job, tmp_path / "torch")]
    assert len(ours) == len(torch_losses) == 3
    assert np.abs(np.array([r["loss"] for r in ours]) - np.array(torch_losses)).max() <= 1e-4, (ours, torch_losses)


@pytest.mark.slow
def test_moe_checkpoints_cross_backends_and_expert_splits(tokens, tmp_path):
    """tiny_moe: torch under ep2 x dp2 (experts split over ep) saves; MindSpore at world 1 resumes
    from its step-2 checkpoint and trains steps 3-6 as torch did; torch ep2 resumes from
    MindSpore's step-4 checkpoint and trains steps 5-6 as before. The z-loss is on; the
    balancing loss is off, because it is computed per rank on its own tokens (dp2 != world 1)."""
    job = job_dict(tokens)
    job["model"] = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
    job["model"]["moe"] |= {"aux_loss_coeff": 0.0, "z_loss_coeff": 0.01}
    job["train"] = job["train"] | {"steps": 6, "checkpoint": {"interval": 2}}
    ep2 = job | {"strategy": job["strategy"] | {"dp": 2, "ep": 2, "zero": {"stage": 1}}}
    first = {r["step"]: r["loss"] for r in _torch_train(ep2, tmp_path / "torch")}
    job["train"]["checkpoint"] = {"interval": 2, "load": str(tmp_path / "torch" / "checkpoints" / "step_00000002")}
    ms = {r["step"]: r["loss"] for r in run_worker(tmp_path / "ms", job)}
    assert sorted(ms) == [3, 4, 5, 6]
    assert max(abs(ms[k] - first[k]) for k in ms) <= 1e-4, (ms, first)
    ep2["train"] = ep2["train"] | {"checkpoint": {"interval": 2, "load": str(tmp_path / "ms" / "checkpoints"
                                                                               / "step_00000004")}}
    back = {r["step"]: r["loss"] for r in _torch_train(ep2, tmp_path / "back")}
    assert sorted(back) == [5, 6]
    assert max(abs(back[k] - first[k]) for k in back) <= 1e-4, (back, first)


@pytest.mark.parametrize("strategy,pipeline", [
    ({"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True}, True),
    ({"dp": 2, "tp": 2, "recompute": {"policy": "full"}}, False),
    ({"dp": 4, "zero": {"stage": 1}}, False),
])
def test_the_ascend_step_builds_under_the_lowering(strategy, pipeline, tmp_path):
    """Everything but the compile (Ascend only): lowering applied, PipelineCell for pp, AdamW as an
    nn.Optimizer under the parallel optimizer's context."""
    ms = pytest.importorskip("mindspore")
    from mindspore import nn

    from ms_llm.mindspore.worker import build_graph_step, logging_rank
    from ms_llm.run import RunFolder
    from ms_llm.strategy.plan import plan

    job = job_from_dict({"model": JOB["model"], "strategy": strategy | {"precision": FP32},
                         "train": {"global_batch_size": 4, "micro_batch_size": 1, "seq_len": 32, "steps": 3}})
    p = plan(job.model, job.strategy, job.train)
    try:
        step = build_graph_step(job, p, RunFolder(tmp_path), rank=0, world=p.world_size, ascend=True)
        assert ms.get_auto_parallel_context("parallel_mode") == "semi_auto_parallel"
        assert ms.get_auto_parallel_context("enable_parallel_optimizer") == (p.zero.stage > 0)
    finally:
        ms.reset_auto_parallel_context()
    assert isinstance(step.optimizer, nn.Optimizer) and step.cell.pipeline == pipeline
    assert step.shape == ((-1, 33) if pipeline else (p.micro_batches, 1, 33))
    assert logging_rank(p) == p.world_size - p.world_size // p.strategy.pp
