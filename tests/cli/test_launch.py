"""The launcher without processes: the job resolved once for both backends, the commands it
builds for torchrun and msrun (one node and several), and one clear line per bad flag."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from ms_llm.cli import main
from ms_llm.data import IndexedDatasetWriter
from ms_llm.errors import ConfigError
from ms_llm.job import load_job
from ms_llm.launch import TrainRequest, prepare
from ms_llm.nodes import Nodes
from ms_llm.run import RunFolder
from torch_backend.launch import torch_command, torchrun

ROOT = Path(__file__).resolve().parents[2]
TORCH_JOB = ROOT / "configs/train/tiny_torch_dp2.yaml"
TWO = Nodes(2, 1, "10.0.0.1", 29400)


def test_one_node_keeps_the_standalone_rendezvous():
    cmd = torchrun(4)
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd
    assert not any(a.startswith(("--nnodes", "--master")) for a in cmd)


def test_several_nodes_use_the_static_rendezvous_at_node_0():
    cmd = torchrun(4, TWO)
    assert cmd[-5:] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--master-addr=10.0.0.1",
                        "--master-port=29400"]
    assert "--standalone" not in cmd and not any(a.startswith("--rdzv") for a in cmd)


def test_torch_workers_start_from_the_run_folder_alone(tmp_path):
    cmd = torch_command(RunFolder(tmp_path), 4, TWO)
    assert cmd[-4:] == ["-m", "torch_backend.worker", "--run-dir", str(tmp_path)]
    assert f"--log-dir={tmp_path / 'logs'}" in cmd and not any(a.endswith(".yaml") for a in cmd)


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="MindSpore is not installed")
@pytest.mark.parametrize("nodes,expect", [
    (Nodes(), ["--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1", "--master_port=5000",
               "--node_rank=0"]),
    (Nodes(2, 1, "10.0.0.1", 29400), ["--worker_num=2", "--local_worker_num=1", "--master_addr=10.0.0.1",
                                      "--master_port=5000", "--node_rank=1"]),
])
def test_msrun_command(tmp_path, nodes, expect):
    from ms_llm.mindspore.launch import msrun_command

    cmd = msrun_command(RunFolder(tmp_path), 2, nodes, 5000)
    assert cmd[1:3] == ["-m", "ms_llm.mindspore.launch"] and cmd[3:8] == expect
    assert cmd[-5:] == ["python", "-m", "ms_llm.mindspore.worker", "--run-dir", str(tmp_path)]
    assert f"--log_dir={tmp_path / 'logs'}" in cmd and "--join=True" in cmd


def test_the_resolved_job_is_written_once_for_the_workers(tmp_path):
    """--steps, the backend, dp and micro-batches from the world size, the stdlib corpus as an
    absolute token file: all in config.yaml, which load_job reads back."""
    job_file = tmp_path / "job.yaml"
    job = yaml.safe_load(TORCH_JOB.read_text())
    job_file.write_text(yaml.safe_dump(job | {"strategy": {"dp": -1}}))
    job, p, run = prepare(TrainRequest(job_file, backend="torch", nproc=2, run_dir=tmp_path / "run", steps=3))
    back = load_job(run.config)
    assert back == job
    s = back.strategy
    assert (back.backend, s.dp, s.pipeline.micro_batches, back.train.steps) == ("torch", 2, 2, 3)
    source = Path(back.train.data.source)
    assert source.is_absolute() and source.is_file() and source.parent == run.data
    assert sorted(q.name for q in run.root.iterdir() if q.is_file()) == ["config.yaml"]      # no temporary files


def test_nodes_sharing_a_run_folder_write_the_same_bytes(tmp_path):
    req = TrainRequest(TORCH_JOB, run_dir=tmp_path / "run", nodes=Nodes(2, 0, "127.0.0.1", 29400))
    prepare(req)
    first = (tmp_path / "run" / "config.yaml").read_bytes()
    prepare(TrainRequest(TORCH_JOB, run_dir=tmp_path / "run", nodes=Nodes(2, 1, "127.0.0.1", 29400)))
    assert (tmp_path / "run" / "config.yaml").read_bytes() == first


@pytest.mark.parametrize("flags,line", [
    (["--nnodes", "0"], "--nnodes: got 0"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank: got 2 with --nnodes 2; use 0 to 1"),
    (["--nnodes", "2", "--node-rank", "-1"], "--node-rank: got -1"),
    (["--nnodes", "2", "--master-port", "29400"], "--master-addr: required with --nnodes 2"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], "--master-port: required with --nnodes 2"),
    (["--master-port", "29400"], "--master-port: only used with --nnodes 2 or more"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "80"], "--master-port: got 80"),
    (["--nnodes", "3", "--master-addr", "h", "--master-port", "29400"],
     "--nnodes: 3 nodes do not divide the world size 2"),
])
def test_bad_node_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, line):
    run = tmp_path / "run"
    assert main(["train", str(TORCH_JOB), "--run-dir", str(run), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err, err
    assert not run.exists()                                  # nothing started, nothing written


def test_a_negative_step_count_stops_in_the_launcher(tmp_path, capsys):
    assert main(["train", str(TORCH_JOB), "--steps", "-2", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--steps: got -2" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_several_nodes_need_one_named_run_folder(capsys):
    assert main(["train", str(TORCH_JOB), "--nnodes", "2", "--master-addr", "h", "--master-port", "29400"]) == 2
    assert "--run-dir: required with --nnodes 2" in capsys.readouterr().err


def test_a_model_smaller_than_the_datas_tokenizer_is_refused_before_launch(tmp_path):
    """prepare-data's PREFIX.json records the tokenizer's vocab_size; every id in this data fits the
    tiny model's 320, but a tokenizer of 32000 would not, and neither does a summary that is not JSON."""
    writer = IndexedDatasetWriter(tmp_path / "ds", np.uint16)
    for doc in np.random.default_rng(0).integers(0, 300, (40, 100)):
        writer.add_document(doc)
    writer.finalize()
    job_file = tmp_path / "job.yaml"
    job = yaml.safe_load(TORCH_JOB.read_text())
    job["train"]["data"] = {"paths": [str(tmp_path / "ds")]}
    job_file.write_text(yaml.safe_dump(job))
    summary = tmp_path / "ds.json"

    def launch(run: str):
        return prepare(TrainRequest(job_file, run_dir=tmp_path / run, steps=2))

    summary.write_text(json.dumps({"documents": 40, "vocab_size": 320}))
    launch("fits")
    summary.write_text(json.dumps({"documents": 40, "vocab_size": 32000}))
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 320, but the tokenizer of .*ds has vocab_size "
                                          r"32000 \(.*ds.json\); use vocab_size >= 32000") as err:
        launch("small")
    summary.write_text('{"vocab_size": 32000,')
    with pytest.raises(ConfigError, match=r"^train.data.paths: .*ds.json is not a prepare-data summary") as bad:
        launch("malformed")
    assert "\n" not in str(err.value) + str(bad.value)
    assert not (tmp_path / "small" / "data").exists() or not any((tmp_path / "small" / "data").iterdir())
