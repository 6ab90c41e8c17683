"""torchtitan 0.3 -> ms_llm -> torchtitan, with torchtitan's own model, optimizer, schedule and
CheckpointManager in the loop (tests/helpers/torchtitan_run_probe.py says what runs and why).

torchtitan trains 8 steps of its job (the command line below, read by its own ConfigManager), saving
step-3, step-6 and step-8. `ms-llm convert-strategy --model` turns that command line into an ms_llm job of the
tiny model (torchtitan's registered llama3 flavors are far larger) and `ms-llm import-run` reads step-3
with it. ms_llm continues steps 4-8 with the same batches on torch and on MindSpore: the losses are
torchtitan's own continuation's within 1e-5 and 1e-4 (from step 5 on they depend on the imported
moments, step count and lr). The torch run's step 6, exported with `ms-llm export-run --to torchtitan`,
is loaded by torchtitan's CheckpointManager, which trains steps 7 and 8 with the lr and losses of its
own run (step 8's loss follows the update made with the exported moments).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.interop.names import meta_to_hf_rotary
from ms_llm.checkpoint.interop.run_state import write_foreign_run
from ms_llm.cli import main as cli
from ms_llm.convert.common import ConversionError
from ms_llm.data import GlobalBatchSampler
from ms_llm.errors import CheckpointError
from torch_backend.dcp import DcpEntries
from torch_backend.interop import torchtitan
from peer_probe import ProbeProcess
from train_run import train_losses

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
PROBE = ROOT / "tests" / "helpers" / "torchtitan_run_probe.py"
SEED, SEQ, BATCH, STEPS, SAVED = 7, 16, 4, 8, 3
MODEL = {"name": "titan_tiny", "vocab_size": 128, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "ffn_hidden_size": 128, "max_seq_len": 64, "rope_theta": 10000.0, "norm_eps": 1e-5,
         "dtype": "float32"}
TITAN_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "hidden_dim": 128,
               "max_seq_len": 64, "rope_theta": 10000.0, "norm_eps": 1e-5}


def _args(dump: Path) -> list[str]:
    """The torchtitan job: float32 (its FSDP mixed-precision policy), AdamW 1e-2 with its default betas,
    eps and decay, warmup 2 then linear decay to 0.1, clipping at 1, a save every 3 steps."""
    return ["--module", "llama3", "--config", "llama3_debugmodel", "--training.local_batch_size", str(BATCH),
            "--training.seq_len", str(SEQ), "--training.steps", str(STEPS), "--training.max_norm", "1.0",
            "--training.mixed_precision_param", "float32", "--optimizer.param_groups.0.optimizer_kwargs.lr", "0.01",
            "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "linear",
            "--lr_scheduler.min_lr_factor", "0.1", "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
            "--debug.seed", str(SEED), "--dump_folder", str(dump)]


class Titan(ProbeProcess):
    """One torchtitan process (torchtitan_run_probe.py) for the module: it trains, then waits while
    ms_llm makes the export it resumes, so torch and torchtitan are imported once."""

    def __init__(self, tmp: Path, args: list[str], batches: Path):
        if not (ORACLES / "torchtitan").is_dir():
            pytest.fail(".oracles/ has no torchtitan: run `make oracles`")
        self.tmp, self.batches, self.next = tmp, batches, tmp / "resume_in.json"
        (tmp / "train_in.json").write_text(json.dumps(self.spec("train", args)))
        super().__init__("torchtitan", [sys.executable, str(PROBE), str(tmp / "train_in.json")], tmp,
                         {**os.environ, "PYTHONPATH": str(ORACLES)}, self.next)

    def spec(self, mode: str, args: list[str]) -> dict:
        return {"mode": mode, "args": args, "model": TITAN_MODEL, "batches": str(self.batches),
                "out": str(self.tmp / f"{mode}.json"), "then": str(self.next) if mode == "train" else ""}

    def result(self, mode: str) -> dict:
        """The probe's out for `mode`, once written (bounded by the probe's own wait)."""
        out = self.read(self.tmp / f"{mode}.json")
        return {k: {int(s): v for s, v in out[k].items()} if isinstance(out[k], dict) else out[k] for k in out}

    def resume(self, args: list[str]) -> dict:
        self.send(self.spec("resume", args))
        return self.result("resume")


def _train(job: Path, run: Path, backend: str, tokens: Path) -> dict[int, float]:
    return train_losses(job, run, backend, "--set", "device=cpu", "--set", f"train.data.source={tokens}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchtitan")
    tokens = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, MODEL["vocab_size"], 64 * SEQ + 1).astype(np.uint16).tofile(tokens)
    sampler = GlobalBatchSampler(np.fromfile(tokens, dtype=np.uint16), SEQ, BATCH, SEED)
    np.save(tmp / "batches.npy", np.stack([sampler.local_batch(k) for k in range(STEPS)]))
    peer = Titan(tmp, _args(tmp / "titan"), tmp / "batches.npy")
    try:
        yield _runs(tmp, tokens, peer)
    finally:
        peer.stop()


def _runs(tmp: Path, tokens: Path, peer: Titan) -> dict:
    """torchtitan's run, ms_llm's import of its step 3 continued on torch, and torchtitan resuming the
    torch run's step 6."""
    titan = peer.result("train")
    (tmp / "titan.args").write_text(" ".join(_args(tmp / "titan")) + "\n")
    (tmp / "model.yaml").write_text(yaml.safe_dump(MODEL))
    assert cli(["convert-strategy", str(tmp / "titan.args"), "--model", str(tmp / "model.yaml"), "--world-size", "1",
                "--to", "ms_llm",
                "-o", str(tmp / "job.yaml")]) == 0
    step3 = tmp / "titan" / "checkpoint" / f"step-{SAVED}"
    assert cli(["import-run", str(step3), "-o", str(tmp / "imported"), "--config", str(tmp / "job.yaml")]) == 0
    job = tmp / "imported" / "job.yaml"
    torch_losses = _train(job, tmp / "run_torch", "torch", tokens)
    assert cli(["export-run", str(tmp / "run_torch" / "checkpoints" / "step_00000006"), "--to", "torchtitan",
                "-o", str(tmp / "export"), "--job", str(tmp / "run_torch" / "config.yaml")]) == 0
    resumed = peer.resume(_args(tmp / "titan") + [
        "--checkpoint.folder", str(tmp / "export"), "--checkpoint.exclude_from_loading", "dataloader",
        "--checkpoint.load_only"])
    return {"tmp": tmp, "titan": titan, "torch": torch_losses, "resumed": resumed, "step3": step3, "tokens": tokens}


@pytest.fixture(scope="module")
def ms_losses(runs):
    return _train(runs["tmp"] / "imported" / "job.yaml", runs["tmp"] / "run_ms", "mindspore", runs["tokens"])


@pytest.mark.slow
def test_import_carries_weights_moments_step_and_lr(runs):
    step3 = runs["step3"]
    imported = Checkpoint.open(runs["tmp"] / "imported" / "checkpoints")
    assert imported.step == SAVED and imported.state["optimizer_step"] == SAVED
    assert imported.state["lr"] == pytest.approx(runs["titan"]["lrs"][SAVED + 1], rel=1e-12)
    entries = DcpEntries(step3)
    # wo has no rotary rows: bit-equal; torchtitan's fused q/k/v moments split and permuted
    name = "model.layers.1.self_attn.o_proj.weight"
    assert np.array_equal(imported.read_full(name), entries.read("layers.1.attention.wo.weight").numpy())
    fused = entries.read("optimizer.state.layers.1.attention.qkv_linear.wqkv.weight.exp_avg_sq").numpy()
    wk = imported.read_full(optim_name("exp_avg_sq", "model.layers.1.self_attn.k_proj.weight"))
    model = imported.model_config()
    assert np.array_equal(wk, meta_to_hf_rotary(torchtitan.unfuse(fused, model)["wk"], model.num_kv_heads))


@pytest.mark.slow
def test_torch_continues_as_torchtitan_does(runs):
    titan = runs["titan"]["losses"]
    assert sorted(runs["torch"]) == list(range(SAVED + 1, STEPS + 1))
    assert [runs["torch"][s] for s in runs["torch"]] == pytest.approx([titan[s] for s in runs["torch"]], abs=1e-5)


@pytest.mark.slow
@pytest.mark.mindspore
def test_mindspore_continues_as_torchtitan_does(runs, ms_losses):
    titan = runs["titan"]["losses"]
    assert sorted(ms_losses) == list(range(SAVED + 1, STEPS + 1))
    assert [ms_losses[s] for s in ms_losses] == pytest.approx([titan[s] for s in ms_losses], abs=1e-4)


@pytest.mark.slow
def test_torchtitan_resumes_the_export_with_the_same_next_losses(runs):
    resumed, titan = runs["resumed"], runs["titan"]
    assert resumed["step"] == 6 and sorted(resumed["losses"]) == [7, 8]
    assert [resumed["lrs"][s] for s in (7, 8)] == pytest.approx([titan["lrs"][s] for s in (7, 8)], rel=1e-12)
    for step in (7, 8):
        assert resumed["losses"][step] == pytest.approx(titan["losses"][step], abs=1e-5), step
        assert resumed["losses"][step] == pytest.approx(runs["torch"][step], abs=1e-5), step


@pytest.mark.slow
def test_the_export_imports_back_without_a_config(runs, tmp_path):
    source = Checkpoint.open(runs["tmp"] / "run_torch" / "checkpoints" / "step_00000006")
    back = Checkpoint.open(write_foreign_run(torchtitan.read_run(runs["tmp"] / "export", None), tmp_path))
    assert back.step == 6 and back.model_config() == source.model_config() and back.names() == source.names()
    assert all(np.array_equal(back.read_full(n), source.read_full(n)) for n in source.names())


@pytest.mark.slow
def test_bad_inputs_are_one_line(runs, tmp_path, capsys):
    step3, job = runs["step3"], runs["tmp"] / "job.yaml"
    with pytest.raises(CheckpointError, match="records neither the head count"):
        torchtitan.read_run(step3, None)
    with pytest.raises(ConversionError, match="convert it first"):
        torchtitan.read_run(step3, runs["tmp"] / "titan.args")
    entries = DcpEntries(step3)
    state = {k: entries.read(k) for k in entries.metadata.state_dict_metadata if k != "dataloader"}

    def saved(name: str, **change) -> Path:
        dcp.save({**state, **change}, storage_writer=dcp.FileSystemWriter(str(tmp_path / name)), no_dist=True)
        return tmp_path / name

    other = saved("other", **{"optimizer.state.norm.weight.exp_avg": torch.zeros(32)})
    with pytest.raises(CheckpointError, match=r"'optim\.exp_avg\.model\.norm\.weight' has shape \[32\]"):
        write_foreign_run(torchtitan.read_run(other, job), tmp_path / "x")
    unsafe = saved("unsafe", **{"train_state.step": re.compile("3")})
    with pytest.raises(CheckpointError, match="'train_state.step' is not a plain value torch.load"):
        torchtitan.read_run(unsafe, job)
    shard = next(saved("truncated").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert cli(["import-run", str(tmp_path / "truncated"), "-o", str(tmp_path / "out"), "--config", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"bytes \[\d+, \d+\) but __0_0\.distcp has \d+", err[0]), err
