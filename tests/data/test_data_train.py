"""`ms-llm train` on an indexed dataset: torch at dp2 and MindSpore at dp1 read the same global
batches from the order the launcher built, so their losses agree within 1e-4, and the validation
loss each reports after the last step equals a single-process torch computation on the same
validation batches within 1e-5."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from ms_llm.data import IndexedDatasetWriter, samples
from ms_llm.job import load_job
from ms_llm.run import lr_at
from ms_llm.run.metrics import read_metrics
from torch_backend.model import Transformer

ROOT = Path(__file__).resolve().parents[2]
FP32 = {"param_dtype": "float32", "compute_dtype": "float32"}


def job(data: Path, strategy: dict) -> dict:
    return {"name": "tiny_indexed", "device": "cpu",
            "model": {"name": "tiny_test", "vocab_size": 320, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                      "num_kv_heads": 2, "ffn_hidden_size": 160, "max_seq_len": 32, "dtype": "float32"},
            "strategy": strategy | {"precision": FP32},
            "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32, "steps": 3, "seed": 7,
                      "optimizer": {"lr": 3.0e-3}, "data": {"paths": [str(data)], "split": "90,10"},
                      "eval": {"interval": 2, "batches": 2}}}


def reference_val_losses(run: Path) -> dict[int, float]:
    """One process trains the run's global batches with torch.optim and evaluates the same
    validation batches after steps 2 and 3."""
    job = load_job(run / "config.yaml")
    t, opt = job.train, job.train.optimizer
    model = Transformer(job.model)
    model.init_weights(t.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                              weight_decay=opt.weight_decay)
    sampler = samples.train_sampler(t, run / "data")
    valid = [torch.from_numpy(b) for b in samples.valid_batches(t, run / "data").batches(t.eval.batches)]

    def loss_of(batch):
        return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    out = {}
    for step in range(t.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, t)
        optim.zero_grad()
        loss_of(torch.from_numpy(sampler.local_batch(step))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optim.step()
        if step + 1 in (2, 3):
            with torch.no_grad():
                out[step + 1] = sum(loss_of(b).item() for b in valid) / len(valid)
    return out


def val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r}


def train(tmp: Path, name: str, backend: str, strategy: dict, data: Path) -> list[float]:
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(job(data, strategy)))
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(tmp / f"{name}.yaml"), "--backend", backend,
                           "--run-dir", str(tmp / name)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "val loss" in proc.stdout                                 # the progress line shows it
    return [r["loss"] for r in read_metrics(tmp / name / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
@pytest.mark.mindspore
def test_both_backends_train_on_an_indexed_dataset(tmp_path):
    pytest.importorskip("mindspore")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "docs", np.uint16) as w:
        for n in rng.integers(5, 200, 120):
            w.add_document(rng.integers(0, 320, int(n)))
    torch_losses = train(tmp_path, "torch", "torch", {"dp": 2}, tmp_path / "docs")
    ms_losses = train(tmp_path, "mindspore", "mindspore", {"dp": 1}, tmp_path / "docs")
    train(tmp_path, "torch_pp2", "torch", {"dp": 1, "pp": 2}, tmp_path / "docs")     # eval through the schedule
    assert len(torch_losses) == len(ms_losses) == 3
    assert abs(torch_losses[0] - np.log(320)) < 0.3                 # uniform random tokens: about ln(vocab)
    assert np.abs(np.array(torch_losses) - np.array(ms_losses)).max() <= 1e-4, (torch_losses, ms_losses)
    reference = reference_val_losses(tmp_path / "torch")
    for backend in ("torch", "mindspore", "torch_pp2"):
        reported = val_losses(tmp_path / backend)
        assert reported.keys() == {2, 3}                        # every eval.interval steps and after the last
        assert all(abs(reported[k] - reference[k]) <= 1e-5 for k in reported), (backend, reported, reference)
