"""MindFormers 2.1 -> ms_llm -> MindFormers, with MindFormers' own LLaMA, AdamW, lr schedule, train-step
wrapper and CheckpointMonitor in the loop (tests/helpers/mindformers_run_probe.py says what runs and why).

MindFormers trains 8 steps of the YAML below on one CPU device, CheckpointMonitor saving every 3 steps in
its 1.x layout (rank_0/<prefix>_rank_0-<epoch>_<step>.safetensors) and its 2.x one (iteration_<n>/ with
model-, opt- files and common.json). `ms-llm import-run` reads step 3 of each with the YAML as --config:
the same tensors and step counts, and so do a folder mindspore.unified_safetensors merged (what
MindFormers resumes a multi-rank run from) and a .ckpt of the same tensors. ms_llm continues steps 4-8
with the same batches on torch and on MindSpore: the losses are MindFormers' own within 1e-5 and 1e-4.
The torch run's step 6, exported with `ms-llm export-run --to mindformers`, is found and loaded by
MindFormers' resume functions, which train steps 7 and 8 with the losses of its own run (within 1e-5);
exported with `--to mindformers2`, MindFormers' 2.x loader puts it into its 2.x network and AdamW bit for
bit as its own converter lays it out. The YAML has no weight decay: MindFormers exempts 1-D weights (the
norms) from it, ms_llm's AdamW decays every weight.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ms_llm.checkpoint import Checkpoint, optim_name, split_optim_name
from ms_llm.checkpoint.interop.run_state import ForeignRun, LazyTensor, write_foreign_run
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.cli import main as cli
from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.schema import from_dict
from ms_llm.data import GlobalBatchSampler
from ms_llm.errors import CheckpointError
from ms_llm.strategy.ir import ParallelStrategy

ms = pytest.importorskip("mindspore")
from ms_llm.mindspore.interop import mindformers, mindformers_names  # noqa: E402  (needs MindSpore)
from ms_llm.mindspore.strategy_file import MsParamLayout, write_strategy_file  # noqa: E402
from peer_probe import ProbeProcess  # noqa: E402
from train_run import train_losses  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
PROBE = ROOT / "tests" / "helpers" / "mindformers_run_probe.py"
SEED, SEQ, BATCH, STEPS, SAVED, VOCAB = 7, 16, 4, 8, 3, 128
YAML = f"""
seed: {SEED}
run_mode: train
use_parallel: False
runner_config: {{epochs: 1, batch_size: {BATCH}, sink_mode: False, gradient_accumulation_steps: 1}}
optimizer: {{type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, weight_decay: 0.0}}
lr_schedule: {{type: ConstantWarmUpLR, learning_rate: 1.e-2, warmup_steps: 0, total_steps: {STEPS}}}
parallel_config: {{data_parallel: 1, model_parallel: 1, pipeline_stage: 1, micro_batch_num: 1}}
callbacks:
  - type: MFLossMonitor
  - {{type: CheckpointMonitor, prefix: tiny, save_checkpoint_steps: {SAVED}, checkpoint_format: safetensors,
     integrated_save: False, async_save: False}}
context: {{mode: 0, device_target: CPU}}
model:
  model_config:
    type: LlamaConfig
    batch_size: {BATCH}
    seq_length: {SEQ}
    hidden_size: 64
    num_layers: 2
    num_heads: 4
    n_kv_heads: 2
    intermediate_size: 128
    vocab_size: {VOCAB}
    rms_norm_eps: 1.0e-5
    pad_token_id: 0
    compute_dtype: float32
    layernorm_compute_type: float32
    softmax_compute_type: float32
    rotary_dtype: float32
    param_init_type: float32
    use_flash_attention: False
    use_rope_slice: True
    fused_rms_norm: False
    qkv_concat: False
  arch: {{type: LlamaForCausalLM}}
runner_wrapper: {{type: MFTrainOneStepCell, scale_sense: 1.0, use_clip_grad: True, max_grad_norm: 1.0}}
"""


class MindFormers(ProbeProcess):
    """One MindFormers process (mindformers_run_probe.py) for the module: it trains, then waits while
    ms_llm makes the exports it resumes, so MindSpore and MindFormers are imported once."""

    def __init__(self, tmp: Path, **paths: Path):
        if not (ORACLES / "mindformers").is_dir():
            pytest.fail(".oracles/ has no mindformers: run `make oracles`")
        self.tmp, self.next = tmp, tmp / "resume_in.json"
        (tmp / "train_in.json").write_text(json.dumps(self.spec("train", then=str(self.next), **paths)))
        super().__init__("MindFormers", [sys.executable, str(PROBE), str(tmp / "train_in.json")], tmp,
                         {**os.environ, "PYTHONPATH": str(ORACLES), "GLOG_v": "3"}, self.next, timeout_s=900)

    def spec(self, mode: str, then: str = "", **paths: Path) -> dict:
        return {"mode": mode, "yaml": str(self.tmp / "mf.yaml"), "batches": str(self.tmp / "batches.npy"),
                "out": str(self.tmp / f"{mode}.json"), "then": then, **{k: str(v) for k, v in paths.items()}}

    def result(self, mode: str) -> dict:
        """The probe's out for `mode`, once written (bounded by the probe's own wait)."""
        out = self.read(self.tmp / f"{mode}.json")
        return {**out, "losses": {int(s): v for s, v in out["losses"].items()}}

    def resume(self, **paths: Path) -> dict:
        self.send(self.spec("resume", **paths))
        return self.result("resume")


def _train(job: Path, run: Path, backend: str, tokens: Path) -> dict[int, float]:
    return train_losses(job, run, backend, "--set", "device=cpu", "--set", f"train.data.source={tokens}",
                        timeout_s=900)


def _hf_named(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """Weights and Adam moments under the Hugging Face names MindFormers' converters take
    (moments as adam_m. / adam_v. + the weight's name, as its AdamW names them)."""
    out = {}
    for name in ckpt.names():
        owned = split_optim_name(name)
        if owned is None or owned[0] in ("exp_avg", "exp_avg_sq"):
            out[{"exp_avg": "adam_m.", "exp_avg_sq": "adam_v."}[owned[0]] + owned[1] if owned else name] = \
                ckpt.read_full(name)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mindformers")
    tokens = tmp / "tokens.bin"          # no 0: MindFormers masks pad_token_id 0 out of the loss
    np.random.default_rng(0).integers(1, VOCAB, 64 * SEQ + 1).astype(np.uint16).tofile(tokens)
    sampler = GlobalBatchSampler(np.fromfile(tokens, dtype=np.uint16), SEQ, BATCH, SEED)
    np.save(tmp / "batches.npy", np.stack([sampler.local_batch(k) for k in range(STEPS)]))
    (tmp / "mf.yaml").write_text(YAML)
    peer = MindFormers(tmp, save=tmp / "mf")
    try:
        yield _runs(tmp, tokens, peer)
    finally:
        peer.stop()


def _runs(tmp: Path, tokens: Path, peer: MindFormers) -> dict:
    """MindFormers' run, ms_llm's imports of its step 3 (both layouts) continued on torch, and
    MindFormers resuming the torch run's step 6 in both export layouts."""
    trained = peer.result("train")
    legacy = tmp / "mf" / "legacy" / "checkpoint" / "rank_0" / f"tiny_rank_0-1_{SAVED}.safetensors"
    v2 = tmp / "mf" / "v2" / f"iteration_{SAVED:08d}"
    for src, out in ((legacy, "imported"), (v2, "imported_v2")):
        assert cli(["import-run", str(src), "-o", str(tmp / out), "--config", str(tmp / "mf.yaml")]) == 0
    job = tmp / "imported" / "job.yaml"
    torch_losses = _train(job, tmp / "run_torch", "torch", tokens)
    assert cli(["export-run", str(tmp / "run_torch" / "checkpoints" / "step_00000006"), "--to", "mindformers",
                "-o", str(tmp / "export"), "--job", str(tmp / "run_torch" / "config.yaml")]) == 0
    step6 = Checkpoint.open(tmp / "run_torch" / "checkpoints" / "step_00000006")
    assert cli(["export-run", str(step6.folder), "--to", "mindformers2", "-o", str(tmp / "export2"),
                "--job", str(tmp / "run_torch" / "config.yaml")]) == 0
    save_file(_hf_named(step6), str(tmp / "hf.safetensors"))
    resumed = peer.resume(load=tmp / "export", load_2x=tmp / "export2" / "mindformers2.yaml", hf=tmp / "hf.safetensors")
    return {"tmp": tmp, "peer": trained, "torch": torch_losses, "resumed": resumed, "tokens": tokens, "legacy": legacy}


@pytest.fixture(scope="module")
def ms_losses(runs):
    return _train(runs["tmp"] / "imported" / "job.yaml", runs["tmp"] / "run_ms", "mindspore", runs["tokens"])


@pytest.mark.slow
def test_both_layouts_import_the_same_state(runs):
    a = Checkpoint.open(runs["tmp"] / "imported" / "checkpoints")
    b = Checkpoint.open(runs["tmp"] / "imported_v2" / "checkpoints")
    assert a.step == b.step == SAVED and a.state["optimizer_step"] == b.state["optimizer_step"] == SAVED
    assert a.names() == b.names() and len(a.names()) == 3 * (2 + 2 * 9 + 1)
    assert all(np.array_equal(a.read_full(n), b.read_full(n)) for n in a.names())
    saved = load_file(str(runs["legacy"]))
    assert np.array_equal(a.read_full("model.layers.1.self_attn.k_proj.weight"),
                          saved["model.layers.1.attention.wk.weight"])
    assert np.array_equal(a.read_full("optim.exp_avg_sq.model.embed_tokens.weight"),
                          saved["adam_v.model.tok_embeddings.embedding_weight"])


@pytest.mark.slow
def test_a_folder_merged_by_mindspore_imports_the_same_state(runs, tmp_path):
    """A multi-rank run is merged by mindspore.unified_safetensors with its strategy files (what
    MindFormers' auto_trans_ckpt does); here the one rank's file with a one-device strategy file."""
    legacy = runs["legacy"]
    (tmp_path / "src" / "rank_0").mkdir(parents=True)
    (tmp_path / "src" / "rank_0" / legacy.name).write_bytes(legacy.read_bytes())
    with safe_open(str(legacy), "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    write_strategy_file(tmp_path / "strategy.ckpt", {k: MsParamLayout((1,), tuple(-1 for _ in shape))
                                                     for k, shape in shapes.items() if len(shape) > 0})
    ms.unified_safetensors(str(tmp_path / "src"), str(tmp_path / "strategy.ckpt"), str(tmp_path / "merged"))
    assert (tmp_path / "merged" / "hyper_param.safetensors").is_file()
    merged = write_foreign_run(mindformers.read_run(tmp_path / "merged", runs["tmp"] / "mf.yaml"), tmp_path / "m")
    a, b = Checkpoint.open(runs["tmp"] / "imported" / "checkpoints"), Checkpoint.open(merged)
    assert b.step == SAVED and b.state == a.state and a.names() == b.names()
    assert all(np.array_equal(a.read_full(n), b.read_full(n)) for n in a.names())


@pytest.mark.slow
def test_torch_continues_as_mindformers_does(runs):
    peer = runs["peer"]["losses"]
    assert sorted(runs["torch"]) == list(range(SAVED + 1, STEPS + 1))
    assert [runs["torch"][s] for s in runs["torch"]] == pytest.approx([peer[s] for s in runs["torch"]], abs=1e-5)


@pytest.mark.slow
def test_mindspore_continues_as_mindformers_does(runs, ms_losses):
    peer = runs["peer"]["losses"]
    assert sorted(ms_losses) == list(range(SAVED + 1, STEPS + 1))
    assert [ms_losses[s] for s in ms_losses] == pytest.approx([peer[s] for s in ms_losses], abs=1e-4)


@pytest.mark.slow
def test_mindformers_resumes_the_export_with_the_same_next_losses(runs):
    resumed, peer = runs["resumed"], runs["peer"]["losses"]
    assert resumed["step"] == resumed["global_step"] == 6 and sorted(resumed["losses"]) == [7, 8]
    assert [resumed["losses"][s] for s in (7, 8)] == pytest.approx([peer[s] for s in (7, 8)], abs=1e-5)
    assert [resumed["losses"][s] for s in (7, 8)] == pytest.approx([runs["torch"][s] for s in (7, 8)], abs=1e-5)


@pytest.mark.slow
def test_the_export_imports_back_without_a_config(runs, tmp_path):
    source = Checkpoint.open(runs["tmp"] / "run_torch" / "checkpoints" / "step_00000006")
    back = Checkpoint.open(write_foreign_run(mindformers.read_run(runs["tmp"] / "export", None), tmp_path))
    assert back.step == 6 and back.model_config() == source.model_config() and back.names() == source.names()
    assert all(np.array_equal(back.read_full(n), source.read_full(n)) for n in source.names())


@pytest.mark.slow
def test_mindformers_2x_loads_the_2x_export_as_its_converter_lays_it_out(runs):
    """export-run --to mindformers2, loaded by MindFormers' own 2.x loader (checkpoint.load_checkpoint) into
    the 2.x network its YAML builds (TeleChat3ForCausalLM) and MindFormers' AdamW: every weight and moment
    equals, bit for bit, the run's Hugging Face tensors put in MindFormers' fused layout by its own
    converter (Qwen3's convert_weight_dict), and the optimizer's step count arrives."""
    v2 = runs["resumed"]["v2"]
    assert v2["compared"] == 3 * (3 + 2 * 6) and v2["equal"] == v2["compared"], v2["unequal"]
    assert v2["weights_not_compared"] == [] and v2["global_step"] == 6


@pytest.mark.slow
def test_the_2x_export_imports_back_bit_for_bit(runs, tmp_path):
    source = Checkpoint.open(runs["tmp"] / "run_torch" / "checkpoints" / "step_00000006")
    back = Checkpoint.open(write_foreign_run(mindformers.read_run(runs["tmp"] / "export2", None), tmp_path))
    assert back.step == 6 and back.state["optimizer_step"] == 6 and back.names() == source.names()
    assert all(np.array_equal(back.read_full(n), source.read_full(n)) for n in source.names())


@pytest.mark.slow
def test_a_ckpt_file_imports_the_same_state(runs, tmp_path):
    """MindFormers' checkpoint_format: ckpt, as mindspore.save_checkpoint writes the same tensors."""
    legacy = runs["legacy"]
    ckpt = tmp_path / "rank_0" / legacy.name.replace(".safetensors", ".ckpt")
    ckpt.parent.mkdir()
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in load_file(str(legacy)).items()], str(ckpt))
    back = Checkpoint.open(write_foreign_run(mindformers.read_run(tmp_path, runs["tmp"] / "mf.yaml"), tmp_path / "m"))
    a = Checkpoint.open(runs["tmp"] / "imported" / "checkpoints")
    assert back.step == SAVED and back.state == a.state and back.names() == a.names()
    assert all(np.array_equal(a.read_full(n), back.read_full(n)) for n in a.names())


def test_2x_fused_names_round_trip_biases_and_qk_norms(tmp_path):
    """Qwen3's layout (q/k norms) with q/k/v biases: linear_qkv.bias fused as the weight, back bit for bit;
    a model outside the 2.x dense writer is named."""
    model = from_dict(ModelConfig, {"name": "q", "vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                    "num_kv_heads": 2, "ffn_hidden_size": 48, "qkv_bias": True, "qk_norm": True},
                      "model")
    rng = np.random.default_rng(0)
    arrays = {}
    for name, p in layout_plan(model, ParallelStrategy(dp=1), 1).params.items():
        for key in (name, optim_name("exp_avg", name), optim_name("exp_avg_sq", name)):
            arrays[key] = rng.standard_normal(p.shape).astype(np.float32)
    tensors = {k: LazyTensor(a.shape, "float32", (lambda a: lambda: a)(a)) for k, a in arrays.items()}
    source = Checkpoint.open(write_foreign_run(ForeignRun("test", model, 4, tensors, {"optimizer_step": 3}),
                                               tmp_path / "src"))
    assert cli(["export-run", str(source.folder), "--to", "mindformers2", "-o", str(tmp_path / "out")]) == 0
    saved = load_file(str(tmp_path / "out" / "iteration_00000004" / "model-0000000-0000001.safetensors"))
    qkv = saved["decoder.layers.1.self_attention.linear_qkv.bias"].reshape(2, 2 * 8 + 2 * 8)
    assert np.array_equal(qkv[:, 16:24].reshape(-1), arrays["model.layers.1.self_attn.k_proj.bias"])
    back = Checkpoint.open(write_foreign_run(mindformers.read_run(tmp_path / "out", None), tmp_path / "back"))
    assert back.step == 4 and back.state["optimizer_step"] == 3 and back.names() == source.names()
    assert all(np.array_equal(back.read_full(n), arrays[n]) for n in source.names())
    moe = dataclasses.replace(model, moe=MoEConfig(num_experts=4, top_k=2))
    with pytest.raises(CheckpointError, match="model.moe: the MindFormers 2.x checkpoint export writes dense"):
        mindformers_names.check_model(moe)


@pytest.mark.slow
def test_bad_inputs_are_one_line(runs, tmp_path, capsys):
    legacy, yaml_file = runs["legacy"], runs["tmp"] / "mf.yaml"
    with pytest.raises(CheckpointError, match="records neither the head count"):
        mindformers.read_run(legacy, None)
    for rank in ("rank_0", "rank_1"):
        (tmp_path / "two" / rank).mkdir(parents=True)
        (tmp_path / "two" / rank / legacy.name.replace("rank_0", rank)).write_bytes(legacy.read_bytes())
    with pytest.raises(CheckpointError, match=r"holds 2 ranks' slices; merge them with mindspore.unified_safetensors"):
        mindformers.read_run(tmp_path / "two", yaml_file)
    (tmp_path / "tiny_rank_0-1_3.ckpt").write_bytes(b"not protobuf")
    with pytest.raises(CheckpointError, match="not a MindSpore checkpoint MindSpore can read"):
        mindformers.read_run(tmp_path / "tiny_rank_0-1_3.ckpt", yaml_file)
    tensors = load_file(str(legacy))
    tensors["adam_m.model.norm_out.weight"] = np.zeros(32, np.float32)
    save_file(tensors, str(tmp_path / legacy.name))
    with pytest.raises(CheckpointError, match=r"'optim\.exp_avg\.model\.norm\.weight' has shape \[32\]"):
        write_foreign_run(mindformers.read_run(tmp_path / legacy.name, yaml_file), tmp_path / "x")
    cut = tmp_path / "cut" / legacy.name
    cut.parent.mkdir()
    cut.write_bytes(legacy.read_bytes()[:-100])
    assert cli(["import-run", str(cut), "-o", str(tmp_path / "out"), "--config", str(yaml_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated: needs bytes up to" in err[0] and legacy.name in err[0], err
