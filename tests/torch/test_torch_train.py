"""`ms-llm train --backend torch` end to end: torchrun, workers, run folder, progress, metrics."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def ms_llm(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ms_llm", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_tiny_dp2_trains_and_fills_the_run_folder(tmp_path):
    run = tmp_path / "run"
    proc = ms_llm("train", "configs/train/tiny_torch_dp2.yaml", "--backend", "torch", "--run-dir", str(run),
                  "--steps", "12")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if "| loss " in line]
    assert any("step     1/12" in line for line in progress) and any("step    12/12" in line for line in progress)
    records = [r for line in (run / "metrics.jsonl").read_text().splitlines() if "step" in (r := json.loads(line))]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0            # it learns
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["memory_gb"] > 0 for r in records)
    assert "$ " in (run / "launcher.log").read_text() and "step    12/12" in (run / "launcher.log").read_text()
    assert len(list(run.glob("logs/*/attempt_0/*/stdout.log"))) == 2      # one log per worker
    assert "dp: 2" in (run / "config.yaml").read_text()
    assert not (run / "tmp").exists()


@pytest.mark.slow
def test_tiny_deepseek_reports_the_mtp_loss_and_the_expert_load(tmp_path):
    """The shipped DeepSeek-style job (MLA, MTP, aux-loss-free routing; dp2 x ep2, ZeRO-1): every
    record and progress line carries the MTP loss and the busiest expert's load over the mean."""
    run = tmp_path / "run"
    proc = ms_llm("train", "configs/train/tiny_deepseek.yaml", "--run-dir", str(run), "--steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [r for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["mtp_loss"] < r["loss"] and r["max_expert_load"] >= 1.0 for r in records), records
    assert all("| mtp loss " in line and "x" in line.split("| max load ")[1]
               for line in proc.stdout.splitlines() if "| loss " in line)


def test_world_size_mismatch_is_one_clear_line(tmp_path):
    proc = ms_llm("train", "configs/train/tiny_torch_dp2.yaml", "--nproc", "3", "--run-dir", str(tmp_path / "r"),
                  timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--nproc: 3 processes, but dp*tp*pp*cp" in proc.stderr
    assert not (tmp_path / "r").exists()                              # nothing started, nothing written


def test_restarts_without_checkpoints_are_refused(tmp_path):
    proc = ms_llm("train", "configs/train/tiny_torch_dp2.yaml", "--max-restarts", "2", "--run-dir",
                  str(tmp_path / "r"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--max-restarts: train.checkpoint.interval is 0" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("key,value", [("checkpoint", {"load": "no/such/checkpoint"}),
                                       ("data", {"source": "no/such/tokens.bin"})])
def test_missing_paths_are_one_clear_line_before_anything_starts(tmp_path, key, value):
    job = yaml.safe_load((ROOT / "configs/train/tiny_torch_dp2.yaml").read_text())
    job["train"][key] = value
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    proc = ms_llm("train", str(config), "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"train.{key}." in proc.stderr and "does not exist" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_launcher_imports_no_framework():
    code = ("import sys, ms_llm.cli, ms_llm.launch; "
            "bad = [m for m in ('torch', 'mindspore') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
