"""DeepSpeed runs into ms_llm and back, with DeepSpeed's own engine in the loop on CPU
(tests/helpers/deepspeed_run_probe.py: two gloo ranks, DS_ACCELERATOR=cpu):
  - DeepSpeed trains a tiny transformers LLaMA 3 steps under ZeRO-1, ZeRO-2 and ZeRO-3 (AdamW, a
    warmup schedule, gradient clipping) on ms_llm's global batches and saves (ZeRO-3 then continues
    5 steps), and in bf16 under ZeRO-2;
  - the import reads what DeepSpeed's own readers read, bit for bit: zero_to_fp32's weights, and
    ds_to_universal's per-parameter weights and moments (its universal folders import the same);
    a bf16 run gives the fp32 masters as optim.master.* and the module's bf16 weights;
  - the ZeRO-3 save, imported by `ms-llm import-run --config ds_config.json`, continues 3 steps on
    torch under tp2 (the strategy change of issue 36: DeepSpeed's flat ZeRO-3 partitions become tensor
    slices) and on MindSpore, its losses DeepSpeed's own continuation's within 1e-5 / 1e-4;
  - `ms-llm export-run --to deepspeed`: DeepSpeed's engine loads the import written as ZeRO-1 and
    retraces its own 5 steps, and the torch run's step 6 written as ZeRO-3 and gives its next 2
    losses; zero_to_fp32 reads the exports' weights as ms_llm holds them;
  - a missing rank, a truncated file, a pickle torch.load(weights_only=True) refuses and a save
    without the model's config.json are one line each.
DeepSpeed's CPU engine refuses fp16 ("Type fp16 is not supported on your device"): the fp16 loss
scale is checked through an export and its import only.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file

from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.cli import main as cli
from torch_backend.interop import deepspeed
from peer_probe import ProbeProcess
from train_run import train_losses

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "helpers" / "deepspeed_run_probe.py"
HF_MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16)
DATA = {"seq_len": 16, "global_batch": 4, "seed": 7}
STEPS, MORE, LR = 3, 5, 1e-2
# ms_llm's `train` of the imported job: CPU, the token file DeepSpeed read, its seed, a save at step 6.
RUN_SETS = ("device=cpu", "train.seed=7", "train.checkpoint.interval=3", "train.log_every=1")


def ds_config(stage: int, dtype: str = "") -> dict:
    return {**({dtype: {"enabled": True}} if dtype else {}),
            "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                         "warmup_num_steps": 2, "warmup_type": "linear"}}}


class Peer(ProbeProcess):
    """The one DeepSpeed run of this module (two ranks of deepspeed_run_probe.py): it trains and
    saves, then waits for the exports ms_llm writes meanwhile (ask), so DeepSpeed starts once."""

    def __init__(self, tmp: Path, spec: dict):
        if not (ROOT / ".oracles" / "deepspeed").is_dir():
            pytest.fail(".oracles/ is missing: run `make oracles` (installs the peers beside .venv)")
        (tmp / "spec.json").write_text(json.dumps({"world": 2, "model": HF_MODEL, "then": str(tmp / "next_0.json"),
                                                   **spec}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / ".oracles"), str(ROOT)])}
        super().__init__("DeepSpeed", [sys.executable, str(PROBE), str(tmp / "spec.json"), str(tmp / "out_0.json")],
                         tmp, env, tmp / "next_0.json", timeout_s=900, log_tail=5000)
        self.asked = 0

    def result(self, path: Path) -> dict:
        """{kind: {run: {step: value}}} once the probe writes `path` (bounded by the probe's own timeouts)."""
        out = self.read(path)
        return {k: {run: {int(s): v for s, v in steps.items()} for run, steps in by_run.items()}
                for k, by_run in out.items()}

    def ask(self, spec: dict) -> dict:
        """More work for the waiting ranks (resume, fp32), and its result."""
        self.asked += 1
        out, waiting = self.tmp / f"out_{self.asked}.json", self.next
        self.next = self.tmp / f"next_{self.asked}.json"
        self.send({**spec, "out": str(out), "then": str(self.next)}, to=waiting)
        return self.result(out)


def train(job: Path, run: Path, backend: str, *sets: str) -> dict[int, float]:
    return train_losses(job, run, backend, "--steps", str(STEPS + 3),
                        *(arg for s in RUN_SETS + sets for arg in ("--set", s)))


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """DeepSpeed's runs: ZeRO-1/2/3 saves at step 3 and their own losses through step 7."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    tokens = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, HF_MODEL["vocab_size"], 4000).astype(np.uint16).tofile(tokens)
    saves = {stage: tmp / f"zero{stage}" for stage in (1, 2, 3)}
    bf16 = {2: tmp / "bf16_zero2"}
    runs = [{"name": f"zero{s}", "config": ds_config(s), "save": str(d), "steps": STEPS, "more": MORE if s == 3 else 0}
            for s, d in saves.items()]
    runs += [{"name": f"bf16_zero{s}", "config": ds_config(s, "bf16"), "save": str(d), "steps": STEPS, "more": 0}
             for s, d in bf16.items()]
    run = Peer(tmp, {"data": {"tokens": str(tokens), **DATA}, "train": runs,
                     "universal": [str(saves[2]), str(saves[3])],
                     "fp32": [str(d) for d in (*saves.values(), *bf16.values())]})
    try:
        (tmp / "ds_config.json").write_text(json.dumps(ds_config(3)))
        yield {"tmp": tmp, "tokens": tokens, "saves": saves, "bf16": bf16, "run": run, **run.result(tmp / "out_0.json")}
    finally:
        run.stop()


@pytest.fixture(scope="module")
def imported(peer):
    """`ms-llm import-run` of the ZeRO-3 save with the run's ds_config.json."""
    out = peer["tmp"] / "imported"
    config = peer["tmp"] / "ds_config.json"
    assert cli(["import-run", str(peer["saves"][3]), "-o", str(out), "--config", str(config)]) == 0
    return out


@pytest.fixture(scope="module")
def torch_run(peer, imported):
    """The import continued on torch under tp2 (DeepSpeed ran ZeRO-3 over dp 2), saving step 6: each rank
    loads its slice of every tensor."""
    run = peer["tmp"] / "torch_run"
    losses = train(imported / "job.yaml", run, "torch", f"train.data.source={peer['tokens']}", "strategy.dp=1",
                   "strategy.tp=2", "strategy.zero.stage=0")
    return run, losses


@pytest.fixture(scope="module")
def resumed(peer, imported, torch_run):
    """DeepSpeed's engine resuming from ms_llm's exports: the import as ZeRO-1 (5 steps; ZeRO-2 has
    the same files), the torch run's tp2 step 6 as ZeRO-3 (2 steps)."""
    tmp = peer["tmp"]
    job = yaml.safe_load((imported / "job.yaml").read_text())
    exports = {"import_zero1": (imported / "checkpoints", 1, MORE), "torch_zero3": (torch_run[0] / "checkpoints", 3, 2)}
    for name, (src, stage, _) in exports.items():
        job["strategy"] = {**job["strategy"], "dp": 2, "zero": {**job["strategy"]["zero"], "stage": stage}}
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(job))
        assert cli(["export-run", str(src), "--to", "deepspeed", "-o", str(tmp / name), "--job",
                    str(tmp / f"{name}.yaml")]) == 0
    out = peer["run"].ask({"resume": [{"name": n, "folder": str(tmp / n), "steps": k}
                                      for n, (_, _, k) in exports.items()],
                           "fp32": [str(tmp / n) for n in exports]})
    return {n: tmp / n for n in exports} | out


def _arrays(run) -> dict[str, np.ndarray]:
    return {name: t.read() for name, t in run.tensors.items()}


@pytest.mark.slow
def test_import_reads_what_deepspeeds_own_readers_read(peer):
    for stage, save in peer["saves"].items():
        run = deepspeed.read_run(save, None)
        assert run.step == STEPS and run.state == {"optimizer_step": STEPS, "lr": LR}
        assert run.job["strategy"]["zero"]["stage"] == stage and run.job["strategy"]["dp"] == 2
        arrays = _arrays(run)
        zero_to_fp32 = load_file(str(save / "zero_to_fp32.safetensors"))
        assert sorted(zero_to_fp32) == sorted(n for n in arrays if not n.startswith("optim."))
        for name, weight in zero_to_fp32.items():
            assert np.array_equal(arrays[name], weight), (stage, name)
        if stage == 1:
            continue
        universal = deepspeed.read_run(save / f"global_step{STEPS}_universal", save / "config.json")
        assert universal.step == STEPS and universal.state == run.state
        assert sorted(universal.tensors) == sorted(arrays)
        for name, array in _arrays(universal).items():       # ds_to_universal's own un-flattening
            assert np.array_equal(arrays[name], array), (stage, name)
        assert np.abs(arrays[optim_name("exp_avg_sq", "model.norm.weight")]).max() > 0


@pytest.mark.slow
def test_bf16_saves_import_fp32_masters_and_bf16_weights(peer):
    """ZeRO-2 saves the module's bf16 weights: its masters rounded (DeepSpeed copies the updated
    masters into the 16-bit weights), which is how the import rebuilds ZeRO-3's, saved empty."""
    for stage, save in peer["bf16"].items():
        run = deepspeed.read_run(save, None)
        assert run.model.dtype == "bfloat16" and run.state == {"optimizer_step": STEPS, "lr": LR}
        for name, master in load_file(str(save / "zero_to_fp32.safetensors")).items():
            assert run.tensors[name].dtype == "bfloat16"
            assert np.array_equal(run.tensors[optim_name("master", name)].read(), master), (stage, name)
            rounded = torch.from_numpy(master).bfloat16().view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(run.tensors[name].read(), rounded), (stage, name)


@pytest.mark.slow
def test_torch_continues_like_deepspeed_under_tp2(peer, imported, torch_run):
    job = yaml.safe_load((imported / "job.yaml").read_text())
    assert job["strategy"]["zero"]["stage"] == 3 and job["train"]["optimizer"]["lr"] == LR
    losses = torch_run[1]
    assert sorted(losses) == [4, 5, 6]
    own = peer["losses"]["zero3"]
    assert [losses[k + 1] for k in range(STEPS, STEPS + 3)] == pytest.approx([own[k] for k in range(3, 6)], abs=1e-5)


@pytest.mark.slow
def test_mindspore_continues_like_deepspeed(peer, imported):
    losses = train(imported / "job.yaml", peer["tmp"] / "ms_run", "mindspore", f"train.data.source={peer['tokens']}",
                   "strategy.dp=1", "strategy.zero.stage=0")
    own = peer["losses"]["zero3"]
    assert [losses[k + 1] for k in range(STEPS, STEPS + 3)] == pytest.approx([own[k] for k in range(3, 6)], abs=1e-4)


@pytest.mark.slow
def test_deepspeed_resumes_from_the_exports(peer, imported, torch_run, resumed):
    own = peer["losses"]["zero3"]
    got = resumed["losses"]
    assert got["import_zero1"] == pytest.approx({k: own[k] for k in range(STEPS, STEPS + MORE)}, abs=1e-5)
    assert resumed["lr"]["import_zero1"] == {k: peer["lr"]["zero3"][k] for k in range(STEPS, STEPS + MORE)}
    assert got["torch_zero3"] == pytest.approx({6: own[6], 7: own[7]}, abs=1e-5)
    for name, src in (("import_zero1", imported / "checkpoints"), ("torch_zero3", torch_run[0] / "checkpoints")):
        with Checkpoint.open(src) as ckpt:
            for weight, array in load_file(str(resumed[name] / "zero_to_fp32.safetensors")).items():
                assert np.array_equal(ckpt.read_full(weight), array), (name, weight)


@pytest.mark.slow
def test_fp16_loss_scale_goes_out_and_back(imported, tmp_path):
    """An fp16 export holds DeepSpeed's dynamic loss scaler, which the import reads back as ms_llm's."""
    job = yaml.safe_load((imported / "job.yaml").read_text())
    job["strategy"] = {**job["strategy"], "precision": {"param_dtype": "float16", "compute_dtype": "float16",
                                                        "loss_scale": "dynamic"}}
    (tmp_path / "fp16.yaml").write_text(yaml.safe_dump(job))
    assert cli(["export-run", str(imported / "checkpoints"), "--to", "deepspeed", "-o", str(tmp_path / "fp16"), "--job",
                str(tmp_path / "fp16.yaml")]) == 0
    run = deepspeed.read_run(tmp_path / "fp16", None)
    assert run.model.dtype == "float16" and run.tensors["model.norm.weight"].dtype == "float16"
    assert run.state["loss_scale"] == {"mode": "dynamic", "scale": 2.0 ** 16, "good_steps": 0, "skipped": 0}


@pytest.mark.slow
def test_bad_inputs_are_one_line(peer, tmp_path, capsys):
    def broken(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(peer["saves"][2], folder)
        return folder / f"global_step{STEPS}"

    rank1 = broken("missing_rank") / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.unlink()
    truncated = broken("truncated") / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    truncated.write_bytes(truncated.read_bytes()[:5000])
    pickled = broken("pickle") / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": argparse_namespace()}, pickled)
    (broken("no_config").parent / "config.json").unlink()
    cases = {"missing_rank": f"{rank1}: missing: the optimizer states of dp rank 1; the save was made by 2 dp ranks",
             "truncated": f"{truncated}: not a whole torch file, truncated?",
             "pickle": f"{pickled}: torch.load(weights_only=True) refuses it (it names argparse.Namespace)",
             "no_config": "no config.json (the model's Hugging Face config)"}
    for name, expected in cases.items():
        assert cli(["import-run", str(tmp_path / name), "-o", str(tmp_path / f"out_{name}")]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ms-llm import-run: error: ") and expected in err[0], (name, err)
        assert not (tmp_path / f"out_{name}").exists()


def argparse_namespace():
    """An object of a class torch.load(weights_only=True) does not allow."""
    import argparse
    return argparse.Namespace(step=1)
