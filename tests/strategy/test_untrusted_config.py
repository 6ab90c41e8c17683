"""Issue 12, configs: every number has bounds, no NaN or infinity, derived sizes cannot overflow,
and a run folder that cannot be written is one line. Each case goes through `ms-llm` in process
and must end in exit status 2 with one line naming the field."""
import dataclasses
import errno
import typing
from pathlib import Path

import pytest
import yaml

from ms_llm.cli import main
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import field_docs, from_dict
from ms_llm.errors import ConfigError, RunFolderError, StrategyError
from ms_llm.job import SECTIONS, job_from_dict
from ms_llm.run.folder import RunFolder

JOB = {"name": "fuzz", "backend": "torch", "device": "cpu",
       "model": {"name": "t", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "ffn_hidden_size": 128, "max_seq_len": 64},
       "strategy": {"dp": 2}, "train": {"global_batch_size": 8, "seq_len": 32, "steps": 2}}


def with_value(path: str, value) -> dict:
    job = yaml.safe_load(yaml.safe_dump(JOB))
    node = job
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return job


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


def refused(tmp_path: Path, capsys, job: dict, field: str, commands=(("plan",),)) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    for command in commands:
        rc, err = run_cli([*command[:1], str(path), *command[1:]], capsys)
        assert rc == 2 and len(err) == 1, (command, err)
        assert field in err[0] and "error" in err[0], err


OVERFLOWS = [("model.num_layers", 1.0e308), ("model.ffn_hidden_size", 1.0e308)]
NON_FINITE = [("model.rope_theta", float("nan")), ("model.norm_eps", float("nan")),
              ("train.optimizer.lr", float("nan")), ("train.checkpoint.mtbf_hours", float("nan")),
              ("strategy.zero.bucket_mb", float("inf")), ("model.rope_theta", float("inf"))]
IMPLAUSIBLE = [("train.global_batch_size", 1e30), ("model.max_seq_len", 1e308), ("train.steps", 1e308),
               ("model.norm_eps", 1e308)]


@pytest.mark.parametrize("field,value", OVERFLOWS + NON_FINITE + IMPLAUSIBLE)
def test_bad_numbers_are_one_line_from_plan(tmp_path, capsys, field, value):
    refused(tmp_path, capsys, with_value(field, value), field)


def test_zero_kv_heads_is_refused_by_plan_and_dry_run_on_both_backends(tmp_path, capsys):
    commands = (("plan",), ("train", "--dry-run"), ("train", "--dry-run", "--backend", "mindspore"))
    refused(tmp_path, capsys, with_value("model.num_kv_heads", 0), "model.num_kv_heads", commands)


def test_left_out_or_null_kv_heads_means_plain_multi_head():
    left_out = {k: v for k, v in JOB["model"].items() if k != "num_kv_heads"}
    for model in (left_out, {**JOB["model"], "num_kv_heads": None}):
        assert job_from_dict({**JOB, "model": model}).model.num_kv_heads == 4


def test_world_size_and_parameter_count_are_bounded(tmp_path, capsys):
    refused(tmp_path, capsys, {**JOB, "strategy": {"dp": 1 << 20, "tp": 1 << 20}}, "strategy: dp*tp*pp*cp")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "strategy": {"dp": -1}}))
    rc, err = run_cli(["plan", str(tmp_path / "job.yaml"), "--world-size", str(10 ** 12)], capsys)
    assert rc == 2 and len(err) == 1 and "the world size = 1000000000000 devices" in err[0]
    huge = {**JOB["model"], "num_layers": 4096, "hidden_size": 1 << 20, "ffn_hidden_size": 1 << 20}
    with pytest.raises(ConfigError, match=r"model: .* parameters is more than"):
        from_dict(ModelConfig, huge, "model")


def _numeric_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
            continue
        args = set(typing.get_args(tp)) | set(typing.get_args(typing.get_args(tp)[0]) if typing.get_args(tp) else ())
        if tp in (int, float) or args & {int, float}:
            yield f"{prefix}{f.name}", f


def test_every_number_field_has_documented_bounds():
    fields = [item for cls in SECTIONS.values() for item in _numeric_fields(cls)]
    assert len(fields) > 40
    unbounded = [path for path, f in fields if f.metadata.get("ge") is None or f.metadata.get("le") is None]
    assert not unbounded, unbounded
    assert field_docs(ModelConfig)["num_layers"].endswith("[1 .. 4096]")


def test_derived_world_size_is_a_strategy_error():
    with pytest.raises(StrategyError, match="1048576"):
        job_from_dict({**JOB, "strategy": {"dp": 1 << 20, "pp": 2}})


@pytest.mark.parametrize("err,reason", [(errno.EACCES, "Permission denied"), (errno.EROFS, "Read-only file system"),
                                        (errno.ENOSPC, "No space left on device")])
def test_unwritable_or_full_run_folder_is_one_line(tmp_path, capsys, monkeypatch, err, reason):
    """Root ignores permission bits, so the operating system's refusal is injected where it
    happens: the first write into the run folder."""
    import builtins
    real_open = builtins.open

    def refusing_open(file, mode="r", *args, **kwargs):
        if "w" in mode and str(tmp_path / "run") in str(file):
            raise OSError(err, reason)
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(RunFolderError, match=rf"run folder .*run: cannot write there \({reason}\)"):
        RunFolder.create("x", tmp_path / "run")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "strategy": {"dp": 1},
                                                       "train": {**JOB["train"], "global_batch_size": 2}}))
    rc, err_lines = run_cli(["train", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 2 and len(err_lines) == 1 and str(tmp_path / "run") in err_lines[0] and reason in err_lines[0]


def test_missing_run_folder_parent_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "strategy": {"dp": 1},
                                                       "train": {**JOB["train"], "global_batch_size": 2}}))
    rc, err = run_cli(["train", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "file" / "run")], capsys)
    assert rc == 2 and len(err) == 1 and "Not a directory" in err[0] and "file/run" in err[0]
