"""import-run and export-run's shared core: write_foreign_run streams a peer's training state (weights,
Adam moments, the head's training state) into an ms_llm checkpoint that reads back exactly, one
tensor in memory at a time; the job import-run writes resumes from it on torch with the imported
optimizer step; the format registry, the overwrite refusal and the commands' errors are one line."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from ms_llm.checkpoint import Checkpoint, optim_name
from ms_llm.checkpoint.interop.peers import PEERS, detect_format, peer_module
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor, write_foreign_run
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.storage.safetensors_io import f32_to_bf16
from ms_llm.commands.import_run import write_import
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.data import build_stdlib_corpus
from ms_llm.errors import CheckpointError, ConfigError
from ms_llm.job import load_job
from ms_llm.run.metrics import read_metrics
from ms_llm.strategy.ir import ParallelStrategy

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(name="imported", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=16, dtype="float32")
TINY = from_dict(ModelConfig, MODEL, "model")
STATE = {"optimizer_step": 2, "lr": 1e-2, "sampler": {"seed": 7, "epoch": 0, "position": 16, "index": ""}}
STEP, BATCH, LR, WD, BETAS, EPS = 4, 4, 1e-2, 0.01, (0.9, 0.95), 1e-8


def peer_arrays(bf16: bool = False, seed: int = 0) -> dict[str, tuple[np.ndarray, str]]:
    """{name: (array, dtype)}: weights (bf16 as raw bits when asked) and fp32 Adam moments, as a
    peer reader hands them over."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in layout_plan(TINY, ParallelStrategy(dp=1), 1).params.items():
        weight = (0.02 * rng.standard_normal(p.shape)).astype(np.float32)
        out[name] = (f32_to_bf16(weight), "bfloat16") if bf16 else (weight, "float32")
        out[optim_name("exp_avg", name)] = ((1e-3 * rng.standard_normal(p.shape)).astype(np.float32), "float32")
        out[optim_name("exp_avg_sq", name)] = (rng.uniform(1e-7, 1e-5, p.shape).astype(np.float32), "float32")
    return out


def foreign(arrays: dict[str, tuple[np.ndarray, str]], *, step: int = STEP, state: dict = STATE,
            job: dict | None = None, track: list | None = None) -> ForeignRun:
    """A ForeignRun whose tensors are read lazily; each read's array goes into `track` (weakly)."""
    def reader(array: np.ndarray):
        def read() -> np.ndarray:
            fresh = array.copy()               # a new array per read, as a file reader returns
            if track is not None:
                track.append(weakref.ref(fresh))
            return fresh
        return read
    tensors = {n: LazyTensor(a.shape, d, reader(a)) for n, (a, d) in arrays.items()}
    return ForeignRun("megatron", TINY, step, tensors, dict(state), job)


def test_round_trip_reads_back_exactly_one_tensor_at_a_time(tmp_path):
    arrays = peer_arrays(bf16=True)
    reads: list[weakref.ref] = []
    alive = []                                 # reads still in memory when the next read starts

    def counting(array):
        def read():
            gc.collect()
            alive.append(sum(r() is not None for r in reads))
            fresh = array.copy()
            reads.append(weakref.ref(fresh))
            return fresh
        return read
    run = foreign(arrays)
    run.tensors = {n: LazyTensor(t.shape, t.dtype, counting(arrays[n][0])) for n, t in run.tensors.items()}
    gc.freeze()                                # the collections above see only what the write makes
    try:
        folder = write_foreign_run(run, tmp_path / "ckpt")
    finally:
        gc.unfreeze()
    assert folder == tmp_path / "ckpt" / "step_00000004" and len(reads) == len(arrays)
    assert max(alive) == 0                     # each tensor is gone before the next is read
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        ckpt.verify()                          # every block checksum the index records holds
        assert ckpt.step == STEP and ckpt.state == {**STATE, "step": STEP} and ckpt.model_config() == TINY
        assert sorted(ckpt.names()) == sorted(arrays)
        for name, (array, dtype) in arrays.items():
            assert ckpt.entry(name).dtype == dtype and np.array_equal(ckpt.read_full(name), array), name


def test_an_existing_step_is_replaced_only_when_asked(tmp_path):
    write_foreign_run(foreign(peer_arrays(seed=1)), tmp_path)
    with pytest.raises(CheckpointError, match="already holds step 4 .*--overwrite"):
        write_foreign_run(foreign(peer_arrays(seed=2)), tmp_path)
    second = peer_arrays(seed=2)
    write_foreign_run(foreign(second), tmp_path, overwrite=True)
    name = "model.norm.weight"
    with Checkpoint.open(tmp_path) as ckpt:
        assert np.array_equal(ckpt.read_full(name), second[name][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004"]


def test_tensors_of_another_model_are_refused_before_anything_is_written(tmp_path):
    arrays = peer_arrays()
    name = optim_name("exp_avg", "model.layers.0.mlp.up_proj.weight")
    wrong = dict(arrays, **{name: (np.zeros((128, 32), np.float32), "float32")})
    with pytest.raises(CheckpointError, match=r"'optim.exp_avg.model.layers.0.mlp.up_proj.weight' has shape "
                                              r"\[128, 32\] but the model's .* is \[64, 32\]"):
        write_foreign_run(foreign(wrong), tmp_path)
    missing = {n: a for n, a in arrays.items() if n != "lm_head.weight"}
    with pytest.raises(CheckpointError, match="lacks weight 'lm_head.weight'"):
        write_foreign_run(foreign(missing), tmp_path)
    extra = dict(arrays, **{"model.layers.2.mlp.up_proj.weight": arrays["model.layers.0.mlp.up_proj.weight"]})
    with pytest.raises(CheckpointError, match="'model.layers.2.mlp.up_proj.weight' is not a weight of the model"):
        write_foreign_run(foreign(extra), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_read_that_differs_from_its_header_names_the_tensor(tmp_path):
    run = foreign(peer_arrays())
    name = "model.norm.weight"
    run.tensors[name] = LazyTensor((32,), "float32", lambda: np.zeros(32, np.float16))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' read as float16 \(32,\), but its header says "
                                              r"float32 \(32,\)"):
        write_foreign_run(run, tmp_path)
    assert list(tmp_path.iterdir()) == []                  # the half-written step is gone


def test_the_iteration_tracker_tells_megatron_from_mindformers(tmp_path):
    """Megatron-LM and MindFormers 2.x both keep latest_checkpointed_iteration.txt at the root, beside
    iter_NNNNNNN and iteration_NNNNNNNN folders; a folder that looks like both is refused, not guessed."""
    megatron, mindformers = tmp_path / "megatron", tmp_path / "mindformers"
    for root, step in ((megatron, "iter_0000003"), (mindformers, "iteration_00000003")):
        (root / step).mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("3")
    assert detect_format(megatron) == "megatron" and detect_format(mindformers) == "mindformers"
    (mindformers / "iter_0000003").mkdir()
    with pytest.raises(CheckpointError, match=r"looks like a checkpoint of megatron and of mindformers; name its "
                                              r"format with --format megatron\|mindformers"):
        detect_format(mindformers)


def test_registry_names_the_folder_and_every_format(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError) as err:
        detect_format(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path}: not a checkpoint of a format ms_llm knows") and "\n" not in message
    assert all(fmt in message for fmt in PEERS) and "--format" in message
    with pytest.raises(CheckpointError, match="format 'fairseq' is not one ms_llm reads or writes; use one of "
                                              "megatron, deepspeed, torchtitan, mindformers"):
        peer_module("fairseq")


def test_without_a_config_the_job_holds_the_model_and_loads_the_import(tmp_path):
    job_path, folder, notes = write_import(foreign(peer_arrays()), tmp_path / "imported")
    job = load_job(job_path)
    assert job.model == TINY and job.train.steps > STEP
    assert (job.train.seed, job.train.global_batch_size) == (7, BATCH)     # the peer's data position's
    assert job.train.checkpoint.load == str((tmp_path / "imported" / "checkpoints").resolve())
    assert folder == tmp_path / "imported" / "checkpoints" / "step_00000004"
    assert any("no --config" in n for n in notes)
    with pytest.raises(CheckpointError, match="already holds job.yaml; pass --overwrite"):
        write_import(foreign(peer_arrays()), tmp_path / "imported")


def test_a_config_of_another_model_is_refused(tmp_path):
    job = {"name": "other", "model": dict(MODEL, hidden_size=64)}
    with pytest.raises(ConfigError, match=r"model: the megatron config gives model.embed_tokens.weight \[264, 64\], "
                                          r"the checkpoint holds \[264, 32\]"):
        write_import(foreign(peer_arrays(), job=job), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_job_that_would_read_other_data_is_refused(tmp_path):
    job = {"name": "other", "model": MODEL, "train": {"seed": 7, "global_batch_size": 8}}
    with pytest.raises(ConfigError, match="train.global_batch_size: the megatron run consumed 16 samples, 2 steps "
                                          "of 8, but its checkpoint is of step 4"):
        write_import(foreign(peer_arrays(), job=job), tmp_path)
    job["train"] = {"seed": 8, "global_batch_size": BATCH}
    with pytest.raises(ConfigError, match="train.seed: the megatron run's data order used seed 7, the job 8"):
        write_import(foreign(peer_arrays(), job=job), tmp_path)
    assert list(tmp_path.iterdir()) == []


def ms_llm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ms_llm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_commands_answer_bad_input_in_one_line(tmp_path):
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "weights.bin").write_bytes(b"\0" * 64)
    cases = [
        (("import-run", str(tmp_path / "unknown"), "-o", str(tmp_path / "out")), "not a checkpoint of a format"),
        (("import-run", str(tmp_path / "unknown"), "-o", str(tmp_path / "out"), "--config", str(tmp_path / "no.sh")),
         "--config: "),
        (("export-run", str(tmp_path / "unknown"), "--to", "megatron", "-o", str(tmp_path / "out")),
         "neither a checkpoint folder"),
        (("export-run", str(tmp_path / "unknown"), "--to", "hf", "-o", str(tmp_path)), "is not empty"),
    ]
    for args, expected in cases:
        out = ms_llm(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ms-llm {args[0]}: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_export_run_to_hf_writes_the_imported_weights(tmp_path):
    arrays = peer_arrays()
    write_foreign_run(foreign(arrays), tmp_path / "ckpt")
    out = ms_llm("export-run", str(tmp_path / "ckpt"), "--to", "hf", "-o", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote {tmp_path / 'hf'}: hf format, step 4, 2 files")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(weights) == sorted(n for n in arrays if not n.startswith("optim."))
    assert all(np.array_equal(weights[n], arrays[n][0]) for n in weights)


@pytest.mark.slow
def test_training_resumes_from_the_import_with_its_optimizer_step(tmp_path):
    """One torch step from an imported step-4 state whose optimizer had made 2 updates (a peer that
    skipped 2): AdamW's bias correction must use t = 3, not 5. The step's own moments (saved at
    step 5) give the update AdamW made, so the weights after it are checked without knowing the
    gradient: w1 = w0 (1 - lr wd) - lr m1 / (1 - b1^t) / (sqrt(v1 / (1 - b2^t)) + eps)."""
    tokens = build_stdlib_corpus(tmp_path / "data", max_bytes=100_000)
    job = {"name": "imported", "backend": "torch", "device": "cpu", "model": MODEL,
           "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": BATCH, "micro_batch_size": 2, "seq_len": 16, "steps": STEP + 1, "seed": 7,
                     "optimizer": {"lr": LR, "weight_decay": WD, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS},
                     "schedule": {"warmup_steps": 0, "decay": "constant"}, "data": {"source": str(tokens)},
                     "checkpoint": {"interval": 1, "async_save": False}}}
    arrays = peer_arrays()
    job_path, _, _ = write_import(foreign(arrays, job=job), tmp_path / "imported")
    assert yaml.safe_load(job_path.read_text())["train"]["checkpoint"]["load"].endswith("imported/checkpoints")
    run = tmp_path / "run"
    out = ms_llm("train", str(job_path), "--run-dir", str(run), "--backend", "torch", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [STEP + 1]
    with Checkpoint.open(run / "checkpoints") as ckpt:
        assert ckpt.step == STEP + 1
        assert ckpt.state["optimizer_step"] == STATE["optimizer_step"] + 1      # the next resume's t stays right
        name = "model.layers.1.mlp.down_proj.weight"
        w0, w1 = arrays[name][0].astype(np.float64), ckpt.read_full(name).astype(np.float64)
        m1 = ckpt.read_full(optim_name("exp_avg", name)).astype(np.float64)
        v1 = ckpt.read_full(optim_name("exp_avg_sq", name)).astype(np.float64)

    def after(t: int) -> np.ndarray:
        return w0 * (1 - LR * WD) - LR * (m1 / (1 - BETAS[0] ** t)) / (np.sqrt(v1 / (1 - BETAS[1] ** t)) + EPS)
    assert np.abs(w1 - after(STATE["optimizer_step"] + 1)).max() < 1e-6
    assert np.abs(w1 - after(STEP + 1)).max() > 1e-3        # the step count from the checkpoint's step
