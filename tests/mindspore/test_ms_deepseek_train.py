"""The shipped MindSpore DeepSeek job (configs/train/tiny_deepseek_ms_dp2.yaml: MLA, sigmoid group
routing with the aux-loss-free expert bias, a shared expert, a dense first layer, one MTP module, dp2 on
two msrun CPU workers) trains through `ms-llm train` and follows the torch backend on the same job
(torchrun, dp2) step for step: the training loss (cross-entropy + MTP + the sequence-wise balance loss)
within 1e-4 and the busiest expert's load, which the bias update steers, exactly. With capacity_factor 1
the capacity dispatch on each rank's tokens drops the copies torch's GShard capacity drops on the same job.

One dropless torch run serves both tests: its first 3 steps are the 3-step run's (the warm-up's rates
do not depend on the step count, and the data, the seed and the bias updates do not either)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ms_llm.job import load_job
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "configs" / "train" / "tiny_deepseek_ms_dp2.yaml"
STEPS = 10          # of the job's 30: the curve has fallen by then, and MindSpore's compile is most of a run
CAPACITY_STEPS = 3  # within the job's 5 warm-up steps: the same rates as STEPS' first 3


def train(backend: str, run: Path, steps: int = STEPS, factor: float | None = None) -> list[dict]:
    """`ms-llm train` of the job for `steps` steps (the job's capacity factor, or `factor`)."""
    extra = [] if factor is None else ["--set", f"model.moe.capacity_factor={factor}"]
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(JOB), "--backend", backend,
                           "--steps", str(steps), "--run-dir", str(run), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if steps == STEPS:                # the job logs every 5 steps: the last of a 3-step run is not printed
        assert f"step    {STEPS}/{STEPS} | loss" in proc.stdout
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def torch_dropless(tmp_path_factory) -> list[dict]:
    """The torch backend (torchrun, dp2) on the job as shipped (dropless), STEPS steps."""
    return train("torch", tmp_path_factory.mktemp("torch_dropless"))


@pytest.mark.slow
@pytest.mark.mindspore
def test_the_mindspore_deepseek_job_follows_the_torch_backend(tmp_path, torch_dropless):
    pytest.importorskip("mindspore")
    job = load_job(JOB)
    assert job.backend == "mindspore" and job.strategy.dp == 2
    assert job.model.mla is not None and job.model.moe.expert_bias and job.model.mtp_layers == 1
    ms_steps, torch_steps = train("mindspore", tmp_path / "ms"), torch_dropless
    ms_loss, torch_loss = (np.array([r["loss"] for r in steps]) for steps in (ms_steps, torch_steps))
    print("step | mindspore loss | torch loss | max/mean expert load (both)")
    for m, t in zip(ms_steps, torch_steps):
        print(f"{m['step']:4d} | {m['loss']:.6f} | {t['loss']:.6f} | {m['max_expert_load']:.3f} {t['max_expert_load']:.3f}")
    assert len(ms_loss) == len(torch_loss) == STEPS
    assert np.abs(ms_loss - torch_loss).max() <= 1e-4, (ms_loss, torch_loss)
    assert ms_loss[-1] < ms_loss[0] - 1.0
    np.testing.assert_allclose([r["max_expert_load"] for r in ms_steps], [r["max_expert_load"] for r in torch_steps],
                               atol=1e-6)


@pytest.mark.slow
@pytest.mark.mindspore
def test_data_parallel_capacity_drop_follows_the_torch_backend(tmp_path, torch_dropless):
    """The job (2 msrun CPU workers, data parallel) with capacity_factor 1: the same capacity dispatch
    on each rank's tokens drops the copies torch's GShard capacity drops on the same job (torchrun,
    dp2): the losses within 1e-4 and the busiest expert's load exactly, step by step; dropless torch's
    loss differs (copies are dropped)."""
    pytest.importorskip("mindspore")
    ours = train("mindspore", tmp_path / "ms", CAPACITY_STEPS, 1.0)
    ref = train("torch", tmp_path / "torch", CAPACITY_STEPS, 1.0)
    loss = {name: np.array([r["loss"] for r in steps]) for name, steps in
            (("ours", ours), ("ref", ref), ("dropless", torch_dropless[:CAPACITY_STEPS]))}
    print("mindspore", loss["ours"], "torch", loss["ref"], "torch dropless", loss["dropless"])
    assert len(loss["ours"]) == len(loss["ref"]) == CAPACITY_STEPS
    assert np.abs(loss["ours"] - loss["ref"]).max() <= 1e-4
    assert [r["max_expert_load"] for r in ours] == pytest.approx([r["max_expert_load"] for r in ref], abs=1e-6)
    assert np.abs(loss["ref"] - loss["dropless"]).max() > 1e-3
