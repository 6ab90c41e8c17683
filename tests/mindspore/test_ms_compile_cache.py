"""MindSpore's compile cache (ms_llm.mindspore.compile_cache): keyed by what the graphs are built
from, kept per run, and shared between runs of one job through MS_LLM_COMPILE_CACHE_DIR."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ms_llm.mindspore.compile_cache import SHARED_ENV, fetch, graph_key, job_cache, publish
from ms_llm.run import RunFolder
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
JOB = {"name": "cache", "backend": "mindspore", "device": "cpu",
       "model": {"name": "t", "vocab_size": 264, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "ffn_hidden_size": 64, "max_seq_len": 16, "dtype": "float32"},
       "strategy": {"dp": 2, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 2, "seed": 7,
                 "data": {"source": "stdlib"}}}


def _text(job: dict) -> str:
    return yaml.safe_dump(job)


def _with(path: str, value) -> dict:
    job = yaml.safe_load(_text(JOB))
    *parents, last = path.split(".")
    node = job
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return job


def test_the_key_follows_the_graphs_and_not_the_host_only_keys(tmp_path):
    """A changed model, strategy, batch, optimizer or world is another cache; a changed name, step
    count, schedule, data, logging or checkpoint policy is the same one."""
    key = graph_key(_text(JOB), 2)
    assert graph_key(_text(JOB), 2) == key and len(key) == 16
    assert graph_key(_text(JOB), 4) != key
    for path, value in (("model.hidden_size", 64), ("strategy.zero", {"stage": 1}), ("train.micro_batch_size", 1),
                        ("train.optimizer", {"weight_decay": 0.5}), ("train.seed", 8), ("train.seq_len", 8)):
        assert graph_key(_text(_with(path, value)), 2) != key, path
    for path, value in (("name", "other"), ("train.steps", 50), ("train.log_every", 5),
                        ("train.schedule", {"warmup_steps": 3}), ("train.data", {"source": "/elsewhere/tokens.bin"}),
                        ("train.checkpoint", {"interval": 2, "load": "/x"}), ("train.memory_limit_gb", 2.0)):
        assert graph_key(_text(_with(path, value)), 2) == key, path
    run = RunFolder(tmp_path)
    run.config.write_text(_text(JOB))
    assert job_cache(run, 2) == run.compile_cache / key


def test_runs_share_whole_rank_folders(tmp_path, monkeypatch):
    """publish copies a rank's graphs to the shared folder once; fetch copies them into a run
    that has none and leaves a run's own graphs alone; neither leaves a partial folder behind."""
    first, second = tmp_path / "a" / "compile_cache" / "k1", tmp_path / "b" / "compile_cache" / "k1"
    (first / "rank_0" / "graph_cache").mkdir(parents=True)
    (first / "rank_0" / "graph_cache" / "g.mindir").write_bytes(b"graph")
    monkeypatch.delenv(SHARED_ENV, raising=False)
    assert not publish(first, 0) and not fetch(second, 0)            # not shared unless asked
    monkeypatch.setenv(SHARED_ENV, str(tmp_path / "shared"))
    assert not fetch(second, 0)                                       # nothing shared yet
    assert publish(first, 0) and not publish(first, 0)               # once
    assert not publish(first, 1)                                      # no graphs of rank 1 to offer
    assert (tmp_path / "shared" / "k1" / "rank_0" / "graph_cache" / "g.mindir").read_bytes() == b"graph"
    assert fetch(second, 0) and (second / "rank_0" / "graph_cache" / "g.mindir").read_bytes() == b"graph"
    (second / "rank_0" / "graph_cache" / "g.mindir").write_bytes(b"mine")
    assert not fetch(second, 0) and (second / "rank_0" / "graph_cache" / "g.mindir").read_bytes() == b"mine"
    assert sorted(p.name for p in (tmp_path / "shared" / "k1").iterdir()) == ["rank_0"]
    assert sorted(p.name for p in second.iterdir()) == ["rank_0"]


@pytest.mark.slow
@pytest.mark.mindspore
def test_a_second_run_of_the_job_loads_the_first_runs_graphs(tmp_path):
    """Two runs of one job in two run folders, sharing a cache folder: the second loads every
    rank's graphs the first compiled (none written during its launch) and trains the same losses."""
    shared = tmp_path / "shared"
    env = dict(os.environ, **{SHARED_ENV: str(shared)})
    losses, started = {}, {}
    for name in ("first", "second"):
        job = _with("name", name)
        (tmp_path / f"{name}.yaml").write_text(_text(job))
        started[name] = time.time()
        proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(tmp_path / f"{name}.yaml"),
                               "--run-dir", str(tmp_path / name)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r]
    [key] = [p.name for p in shared.iterdir()]
    assert sorted(p.name for p in (shared / key).iterdir()) == ["rank_0", "rank_1"]
    loaded = list((tmp_path / "second" / "compile_cache" / key).rglob("*.mindir"))
    assert {f.relative_to(tmp_path / "second" / "compile_cache" / key).parts[0] for f in loaded} == {"rank_0", "rank_1"}
    assert all(f.stat().st_mtime < started["second"] for f in loaded), "the second run compiled again"
    assert len(losses["first"]) == 2 and losses["second"] == losses["first"]
