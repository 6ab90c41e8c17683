"""Exports and imports: Hugging Face (transformers loads it), torch DCP, MindSpore's own
tools, torch -> MindSpore -> torch resharding, and the convert-checkpoint command."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_helpers import TINY, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, optim_name, param_pieces, run_config
from ms_llm.checkpoint.interop.hf import export_hf, hf_source, import_hf
from ms_llm.checkpoint.interop.names import hf_to_meta_rotary, meta_to_hf_rotary
from ms_llm.cli import main as cli
from ms_llm.config.hf import hf_config
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError
from model_families import family_config
from torch_backend.checkpoint import load_into
from torch_backend.dcp import export_dcp, import_dcp
from torch_backend.model import Transformer, apply_rotary, rotary_tables

HERE = Path(__file__).parents[1] / "helpers"


def _write(root, ref, strategy=None, world=1, model=TINY):
    plan = plan_for(strategy or {"dp": 1}, world, model)
    for rank in reversed(range(world)):
        w = CheckpointWriter(root, rank, world)
        items = []
        for n, p in rank_pieces(plan, rank).items():
            if n in ref and p.primary:
                box = ref[n][tuple(slice(o, o + s) for o, s in zip(p.region.offsets, p.region.sizes))]
                items.append(SaveItem(p, np.ascontiguousarray(box)))
        w.save(5, items, state={"step": 5}, config=run_config(plan, "torch"))
        w.close()
    return plan


@pytest.mark.parametrize("tied", [False, True])
def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    model = dataclasses.replace(TINY, tie_embeddings=True) if tied else TINY
    ref = {n: a * 0.05 for n, a in reference(model).items() if not n.startswith("optim.")}
    _write(tmp_path / "ckpt", ref, {"tp": 2}, 2, model)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=200_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    sd = hf.state_dict()
    for name, array in ref.items():
        assert np.array_equal(sd[name].numpy(), array), name
    ours = Transformer(model).eval()
    load_into(Checkpoint.open(tmp_path / "ckpt"), param_pieces(plan_for({"dp": 1}, 1, model), 0),
              dict(ours.named_parameters()))
    tokens = torch.randint(0, model.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("family", ["llama3.1", "qwen2", "qwen3"])
def test_transformers_folder_imports_and_exports_with_equal_logits(tmp_path, family):
    """A folder transformers 5 writes (rope_parameters, dtype) imports as the same model: GQA,
    Llama-3.1 rope scaling, Qwen biases and q/k norms give transformers' logits; exported back,
    transformers loads the same class and weights."""
    transformers = pytest.importorskip("transformers")
    cfg = family_config(family)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config(cfg, "float32")))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    hf.eval().save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written and written["dtype"] == "float32"
    imported = Checkpoint.open(import_hf(tmp_path / "hf", tmp_path / "ckpt"))
    model = imported.model_config()
    assert dataclasses.replace(model, name=cfg.name) == cfg
    ours = Transformer(model).eval()
    load_into(imported, param_pieces(plan_for({"dp": 1}, 1, model), 0), dict(ours.named_parameters()))
    tokens = torch.randint(0, model.vocab_size, (2, model.max_seq_len))
    with torch.no_grad():
        want = hf(tokens).logits
        assert (ours(tokens) - want).abs().max().item() <= 1e-5
        export_hf(tmp_path / "ckpt", tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert type(back) is type(hf)
        assert torch.equal(back(tokens).logits, want)


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type='longrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "lacks 'low_freq_factor'"),
    ({"attention_bias": True}, "attention_bias=True"), ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"), ({"dtype": "int8"}, "dtype='int8'"),
    ({"rope_theta": 5e5}, "rope_theta=500000.0 disagrees with rope_parameters.rope_theta=1000000.0"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
])
def test_hf_import_refuses_what_the_model_does_not_compute(tmp_path, change, match):
    ref = {n: a for n, a in reference().items() if not n.startswith("optim.")}
    _write(tmp_path / "ckpt", ref)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 1e6
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=re.escape(match)):
        hf_source(tmp_path / "hf")


def test_transformers4_spelling_reads_the_same(tmp_path):
    """rope_theta + rope_scaling + torch_dtype (transformers 4) give what rope_parameters + dtype give."""
    ref = {n: a for n, a in reference().items() if not n.startswith("optim.")}
    _write(tmp_path / "ckpt", ref)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype="bfloat16")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    new = {**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(new))
    five = hf_source(tmp_path / "hf").model_config()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=5e5, torch_dtype="bfloat16", rope_scaling={
        k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(old))
    assert hf_source(tmp_path / "hf").model_config() == five
    assert five.rope_theta == 5e5 and five.rope_scaling.type == "llama3" and five.dtype == "bfloat16"
    del old["torch_dtype"]                      # no dtype named: the one the weights are stored in
    (tmp_path / "hf" / "config.json").write_text(json.dumps(old))
    assert hf_source(tmp_path / "hf").model_config().dtype == "bfloat16"


def test_hf_import_and_bf16_export(tmp_path):
    ref = {n: a for n, a in reference().items() if not n.startswith("optim.")}
    _write(tmp_path / "ckpt", ref)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = Checkpoint.open(tmp_path / "back")
    assert back.model_config().hidden_size == TINY.hidden_size
    assert all(np.array_equal(back.read_full(n), ref[n]) for n in ref)
    export_hf(tmp_path / "ckpt", tmp_path / "hf16", dtype="bfloat16")
    import safetensors.torch
    t = safetensors.torch.load_file(str(tmp_path / "hf16" / "model.safetensors"))["model.norm.weight"]
    assert t.dtype == torch.bfloat16 and torch.equal(t, torch.from_numpy(ref["model.norm.weight"]).bfloat16())


@pytest.mark.parametrize("names", ["hf", "torchtitan"])
def test_dcp_round_trip(tmp_path, names):
    ref = reference()
    _write(tmp_path / "ckpt", ref, {"dp": 2, "zero": {"stage": 1}}, 2)
    export_dcp(tmp_path / "ckpt", tmp_path / "dcp", names=names)
    import_dcp(tmp_path / "dcp", tmp_path / "back", TINY, names=names)
    back = Checkpoint.open(tmp_path / "back")
    expected = ref if names == "hf" else {n: a for n, a in ref.items() if not n.startswith("optim.")}
    assert back.names() == sorted(expected)
    assert all(np.array_equal(back.read_full(n), expected[n]) for n in expected)


def test_torchtitan_rotary_permutation_preserves_attention_scores():
    """q.k scores with HF weights and rotate_half equal those with torchtitan's permuted weights
    and interleaved (complex) rotary."""
    cfg, heads, hd = TINY, TINY.num_heads, TINY.head_dim
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((cfg.hidden_size, cfg.hidden_size)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((5, cfg.hidden_size)).astype(np.float32))
    cos, sin = rotary_tables(cfg)
    q_hf = (x @ torch.from_numpy(wq).T).view(5, heads, hd).transpose(0, 1)
    q_hf = apply_rotary(q_hf, cos[:5], sin[:5])
    q_meta = (x @ torch.from_numpy(hf_to_meta_rotary(wq, heads)).T).view(5, heads, hd // 2, 2)
    freqs = torch.polar(torch.ones(5, hd // 2), torch.outer(torch.arange(5).float(), 1.0 / (
        cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))))
    q_meta = torch.view_as_real(torch.view_as_complex(q_meta.contiguous()) * freqs[:, None]).reshape(5, heads, hd)
    scores_hf = q_hf @ q_hf.transpose(1, 2)
    scores_meta = q_meta.transpose(0, 1) @ q_meta.transpose(0, 1).transpose(1, 2)
    assert torch.allclose(scores_hf, scores_meta, atol=1e-3, rtol=1e-5)
    assert np.array_equal(meta_to_hf_rotary(hf_to_meta_rotary(wq, heads), heads), wq)


@pytest.mark.mindspore
@pytest.mark.parametrize("strategy", [{"tp": 2, "pp": 2}, {"dp": 2, "tp": 2, "zero": {"stage": 3}},
                                      {"dp": 4, "zero": {"stage": 1, "shard_size": 2}}])
def test_mindspore_transform_checkpoints_merges_our_export(tmp_path, strategy):
    ms = pytest.importorskip("mindspore")
    from ms_llm.mindspore.checkpoint import MS_STATE_BACK, export_mindspore, import_mindspore
    from ms_llm.mindspore.strategy_file import read_strategy_file

    ref = reference()
    _write(tmp_path / "ckpt", ref)
    target = plan_for(strategy, 4)
    export_mindspore(tmp_path / "ckpt", tmp_path / "ms", target)
    if "zero" in strategy:
        entries, _ = read_strategy_file(tmp_path / "ms" / "strategy" / "rank_1.ckpt")
        assert any(e.opt_shard_size > 1 for e in entries.values())     # ZeRO slices as optimizer shards
    strategy_file = tmp_path / "ms" / "strategy" / "rank_0.ckpt"
    if target.strategy.pp > 1:
        ms.merge_pipeline_strategys(str(tmp_path / "ms" / "strategy"), str(tmp_path / "merged.ckpt"))
        strategy_file = tmp_path / "merged.ckpt"
    ms.transform_checkpoints(str(tmp_path / "ms"), str(tmp_path / "full"), "full_", str(strategy_file), None)
    full = ms.load_checkpoint(str(tmp_path / "full" / "rank_0" / "full_0.ckpt"))
    assert len(full) == len(ref)
    for name, param in full.items():
        head, _, rest = name.partition(".")
        ours = optim_name(MS_STATE_BACK[head], rest) if head in MS_STATE_BACK else name
        assert np.array_equal(param.asnumpy(), ref[ours]), name
    import_mindspore(tmp_path / "ms", tmp_path / "ms" / "strategy", tmp_path / "back", TINY)
    back = Checkpoint.open(tmp_path / "back")
    assert all(np.array_equal(back.read_full(n), ref[n]) for n in ref)


@pytest.mark.slow
@pytest.mark.mindspore
def test_torch_to_mindspore_and_back(tmp_path):
    """4 torch ranks (tp2 x pp2) save; 2 MindSpore ranks (dp2, ZeRO-1) load their pieces into
    Parameters and save them; one torch process loads that into our Transformer."""
    pytest.importorskip("mindspore")
    from ckpt_dist import run_jobs

    ref = reference()
    job = {"root": str(tmp_path / "torch"), "step": 3, "save": {"strategy": {"tp": 2, "pp": 2}, "world": 4},
           "load": {"strategy": {"tp": 2, "pp": 2}, "world": 4}}
    assert run_jobs([job], tmp_path / "r.json")[0]["bad"] == []
    ms_strategy = {"dp": 2, "zero": {"stage": 1}}
    procs = [subprocess.Popen([sys.executable, str(HERE / "ckpt_ms_worker.py"), str(tmp_path / "torch"),
                               str(tmp_path / "ms"), json.dumps(ms_strategy), "2", str(r)], cwd=HERE)
             for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    back = Checkpoint.open(tmp_path / "ms")
    assert back.config["backend"] == "mindspore" and back.step == 9
    head = json.loads((back.folder / "index.json").read_text())
    assert [record["also"] for record in head["parts"]] == [[], [0]]     # rank 1's weights are rank 0's replicas
    model = Transformer(TINY)
    load_into(back, param_pieces(plan_for({"dp": 1}, 1), 0), dict(model.named_parameters()))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(ref[name])), name
    assert all(np.array_equal(back.read_full(n), ref[n]) for n in ref)


@pytest.mark.mindspore
def test_mindspore_load_into_widens_bfloat16_exactly(tmp_path):
    """A bfloat16 checkpoint (a torch bf16 run's, a Hugging Face import) loads into the float32
    Parameters MindSpore holds on a CPU, widened exactly, through the Tensor load_into makes over
    the read array's memory."""
    ms = pytest.importorskip("mindspore")
    from ms_llm.checkpoint import Piece, Region
    from ms_llm.checkpoint.storage.safetensors_io import bf16_to_f32, f32_to_bf16
    from ms_llm.mindspore.checkpoint import load_into as ms_load_into

    bits = f32_to_bf16(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    piece = Piece("w", (8, 16), Region((0, 0), (8, 16)))
    writer = CheckpointWriter(tmp_path, 0, 1, session="bf16")
    writer.save(1, [SaveItem(piece, bits, "bfloat16")])
    writer.close()
    param = ms.Parameter(ms.Tensor(np.zeros((8, 16), np.float32)), name="w")
    with Checkpoint.open(tmp_path) as ckpt:
        assert ms_load_into(ckpt, {"w": piece}, {"w": param}) == ["w"]
    assert param.dtype == ms.float32 and np.array_equal(param.asnumpy(), bf16_to_f32(bits))


def test_convert_checkpoint_command(tmp_path, capsys):
    ref = reference()
    _write(tmp_path / "ckpt", ref, {"tp": 2}, 2)
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(json.dumps(to_dict(TINY)))
    assert cli(["convert-checkpoint", str(tmp_path / "ckpt"), str(tmp_path / "re"), "--strategy", "dp2",
                "--world-size", "2"]) == 0
    re = Checkpoint.open(tmp_path / "re")
    assert re.index.world_size == 2 and re.config["strategy"]["dp"] == 2
    assert cli(["convert-checkpoint", str(tmp_path / "re"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert cli(["convert-checkpoint", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--from", "hf", "--to", "dcp",
                "--names", "torchtitan"]) == 0
    assert cli(["convert-checkpoint", str(tmp_path / "dcp"), str(tmp_path / "back"), "--from", "dcp",
                "--names", "torchtitan", "--model", str(model_yaml)]) == 0
    back = Checkpoint.open(tmp_path / "back")
    assert all(np.array_equal(back.read_full(n), ref[n]) for n in back.names()) and len(back.names()) == 39
    assert cli(["convert-checkpoint", str(tmp_path / "dcp"), str(tmp_path / "x"), "--from", "dcp"]) == 2
    assert "--model is required" in capsys.readouterr().err
    # what was written is named; nothing saved is replaced without --overwrite
    before = (tmp_path / "re" / "step_00000005" / "index.json").read_bytes()
    assert cli(["convert-checkpoint", str(tmp_path / "ckpt"), str(tmp_path / "re"), "--strategy", "dp2",
                "--world-size", "2"]) == 2
    assert "already holds step 5" in capsys.readouterr().err
    assert (tmp_path / "re" / "step_00000005" / "index.json").read_bytes() == before
    assert cli(["convert-checkpoint", str(tmp_path / "re"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert cli(["convert-checkpoint", str(tmp_path / "re"), str(tmp_path / "hf"), "--to", "hf", "--overwrite"]) == 0
    assert "hf format, step 5" in capsys.readouterr().out
    assert cli(["ckpt-interval", "--checkpoint", str(tmp_path / "ckpt"), "--iter", "0.5", "--mtbf-hours", "12"]) == 0
    out = capsys.readouterr().out
    assert "tau* = sqrt(2*t_stall*MTBF)" in out and "-> every" in out
