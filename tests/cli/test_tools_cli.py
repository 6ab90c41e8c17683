"""The three tools as users run them: `python tools/X.py` from anywhere, and `ms-llm <command>`."""
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm.cli import main
from ms_llm.convert import ReadOptions, load
from ms_llm.job import load_job

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "configs" / "examples"
CORE = ["ms_llm.convert", "ms_llm.commands.convert", "ms_llm.commands.estimate", "ms_llm.commands.search",
        "ms_llm.strategy.search"]


@pytest.mark.parametrize("tool", ["convert_strategy.py", "estimate_memory.py", "search_strategy.py"])
def test_tools_run_from_a_fresh_clone(tool, tmp_path):
    """No install, no PYTHONPATH, another working directory: the script finds its own checkout."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {tool}") and "--world-size" in out.stdout


def test_core_modules_import_no_framework():
    code = f"import sys; import {', '.join(CORE)}; print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_convert_strategy_writes_a_file(tmp_path, capsys):
    target = tmp_path / "train.sh"
    assert main(["convert-strategy", str(FIXTURES / "mindformers_r1_llama2_70b.yaml"), "-o", str(target)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {target} (megatron)" in err and "warning: read: train_dataset" in err
    back = load(target)
    assert (back.job.strategy.tp, back.job.strategy.pp, back.world_size) == (4, 8, 64)


def test_convert_strategy_errors_are_one_line(capsys, tmp_path):
    assert main(["convert-strategy", str(tmp_path / "missing.yaml"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ms-llm convert-strategy: error: {tmp_path / 'missing.yaml'}: no such file"
    assert main(["convert-strategy", str(FIXTURES / "megatron_llama3_8b.sh")]) == 2
    assert "--to: give the output format" in capsys.readouterr().err
    assert main(["convert-strategy", str(FIXTURES / "megatron_llama3_8b.sh"), "--to", "deepspeed", "--strict"]) == 2
    assert "--strict" in capsys.readouterr().err


def test_estimate_table_and_plot(tmp_path, capsys):
    png = tmp_path / "memory.png"
    assert main(["estimate", str(FIXTURES / "mindformers_r1_llama2_70b.yaml"),
                 str(ROOT / "configs" / "train" / "llama2_70b_dp2_tp4_pp8.yaml"), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "mindformers_r1_llama2_70b  64 x 910b" in out and "llama2_70b_dp2_tp4_pp8" in out
    assert "activations" in out and "tok/s/dev" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_estimate_json(capsys):
    assert main(["estimate", str(FIXTURES / "deepspeed_zero3_offload.json"), "--model", "llama2_7b", "--json"]) == 0
    import json
    data = json.loads(capsys.readouterr().out)
    assert data[0]["world_size"] == 8 and data[0]["memory_bytes"]["host_offload"] > 0 and data[0]["fits"]


def test_search_writes_the_best_and_ranks_a_reference(tmp_path, capsys):
    best = tmp_path / "best.yaml"
    args = ["search", str(FIXTURES / "mindformers_r1_llama2_70b.yaml"), "--compare",
            str(FIXTURES / "mindformers_r1_llama2_70b.yaml"), "--top", "3", "-o", str(best)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "searched" in out and "mindformers_r1_llama2_70b (#" in out and "rank" in out
    job = load_job(best)
    assert job.strategy.dp * job.strategy.tp * job.strategy.pp * job.strategy.cp == 64
    assert job.strategy.precision.param_dtype == "float16"            # kept from the input


def test_search_to_another_format(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(["search", "--model", "llama3_8b", "--world-size", "16", "--global-batch-size", "64", "--seq-len",
                 "8192", "--device", "h100", "-o", str(out)]) == 0
    conv = load(out, options=ReadOptions(world_size=16))
    assert conv.job.train.global_batch_size == 64 and conv.job.model.name == "llama3_8b"
    assert main(["search", "--model", "llama3_8b"]) == 2
    assert "--global-batch-size" in capsys.readouterr().err
