"""`ms-llm plan` end to end, through `python -m ms_llm` in a subprocess like a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ms_llm(*args):
    return subprocess.run([sys.executable, "-m", "ms_llm", *args], capture_output=True, text=True, cwd=ROOT)


def test_plan_table_for_llama2_70b():
    out = ms_llm("plan", "configs/train/llama2_70b_dp2_tp4_pp8.yaml")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "on 64 x Ascend 910B" in text and "mesh       pp8 x dp_replicate2 x dp_shard1 x cp1 x tp4" in text
    assert "tp: 16 groups of 4, rank 0 in [0, 1, 2, 3]" in text
    assert "stage 0: chunk 0: embed, layers 0-9" in text and "stage 7: chunk 0: layers 70-79, norm+lm_head" in text
    assert "(fits)" in text and "MFU" in text and "all-gather + reduce-scatter (sequence parallel)" in text


def test_plan_json_world_size_and_device():
    out = ms_llm("plan", "configs/train/llama2_7b_dp8_zero1.yaml", "--json", "--device", "h100")
    data = json.loads(out.stdout)
    assert data["world_size"] == 8 and data["strategy"]["zero"]["stage"] == 1
    assert data["memory_bytes"]["optimizer"] == data["memory_bytes"]["params"] * 6 / 8   # 12 psi / 8 vs 2 psi
    assert data["params"]["model.layers.0.self_attn.q_proj.weight"]["placements"][-1] == "S(0)"
    out = ms_llm("plan", "configs/train/gpt3_175b_tp8_pp16.yaml", "--world-size", "1024")
    assert out.returncode == 0 and "dp8, tp8, pp16" in out.stdout


def test_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama2_7b\nstrategy: {dp: 3, tp: 3}\ntrain: {global_batch_size: 9}\n")
    out = ms_llm("plan", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "model.num_heads = 32 is not divisible by 3" in out.stderr
    out = ms_llm("plan", "configs/train/llama2_7b_dp8_zero1.yaml", "--world-size", "12")
    assert out.returncode == 2 and "but the world size is 12" in out.stderr


def test_checkpoint_commands_live_in_the_cli_layer():
    out = ms_llm("ckpt-interval", "--stall", "2", "--total", "30", "--iter", "1.2")
    assert out.returncode == 0 and "tau* = sqrt(2*t_stall*MTBF) = 587.9 s" in out.stdout
    out = ms_llm("ckpt-interval", "--stall", "2")
    assert out.returncode == 2 and "ckpt-interval: give --stall, --total" in out.stderr
    out = ms_llm("convert-checkpoint", "--help")
    assert out.returncode == 0 and "--ms-strategy" in out.stdout and "--names {hf,torchtitan}" in out.stdout
    out = ms_llm("convert-checkpoint", "missing", "out", "--from", "dcp")
    assert out.returncode == 2 and "convert-checkpoint: --model is required" in out.stderr


def test_plan_reports_the_backend_and_its_engine():
    out = ms_llm("plan", "configs/train/llama2_7b_dp8_zero1.yaml", "--backend", "torch", "--device", "h100")
    assert out.returncode == 0 and out.stdout.rstrip().endswith("backend    torch on cuda: ZeRO engine shared")
    out = ms_llm("plan", "configs/train/llama2_70b_dp2_tp4_pp8.yaml", "--backend", "mindspore", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["backend"] == {
        "backend": "mindspore", "accelerator": "ascend", "engine": "grad_reducer", "runs": True, "refusals": []}
