"""Inputs found by fault injection (issue 39, items 8-10), each refused in one line before anything
is launched or written: an unknown device under `train`, a job name that is not a safe folder name,
and a YAML document whose aliases expand past a bound (a "billion laughs"); a value quoted in a
config error is cut short whatever its size."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ms_llm.cli import main
from ms_llm.errors import ConfigError
from ms_llm.job import load_job, parse_yaml

JOB = {"name": "faults", "model": "tiny", "device": "cpu", "strategy": {"dp": 1},
       "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "seq_len": 16}}


def job(tmp_path: Path, text: str | None = None, **changes) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({**JOB, **changes}))
    return path


def one_line(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err[:2000]
    return lines[0]


# ---- 8. device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dry_run", [False, True])
def test_train_refuses_an_unknown_device_before_launch(tmp_path, capsys, dry_run):
    config, run = job(tmp_path, device="quantum_9000"), tmp_path / "run"
    line = one_line(["train", str(config), "--run-dir", str(run)] + (["--dry-run"] if dry_run else []), capsys)
    assert "device: unknown device 'quantum_9000'; known: h100, h800, h200, a100, 910b, cpu" in line
    assert not run.exists()
    assert "unknown device 'quantum_9000'" in one_line(["plan", str(config)], capsys)


# ---- 9. job names ---------------------------------------------------------------------------------
RULE = r"name: got .*; a job name is 1-128 characters from A-Z a-z 0-9 . _ - and does not start with '.'"


@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "", "a b", "naïve", "x" * 129, "x\nprint"])
def test_unsafe_job_names_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match=RULE):
        load_job(job(tmp_path, name=name))


@pytest.mark.parametrize("name", ["tiny_torch_dp2", "a.b-c_1", "x" * 128, "0"])
def test_safe_job_names_pass(tmp_path, name):
    assert load_job(job(tmp_path, name=name)).name == name


def test_train_with_an_escaping_name_writes_nothing(tmp_path, capsys, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    line = one_line(["train", str(job(tmp_path, name="../../x"))], capsys)
    assert "name: got '../../x'; a job name is 1-128 characters" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "job.yaml"]
    line = one_line(["plan", str(job(tmp_path)), "--set", "name=../x"], capsys)
    assert "name: got '../x'" in line


def test_a_huge_name_is_quoted_short(tmp_path, capsys):
    line = one_line(["plan", str(job(tmp_path, name="x" * 100_000))], capsys)
    assert "name: got 'xxxx" in line and len(line) < 400


# ---- 10. YAML alias bombs and the size of quoted values ---------------------------------------------
def bomb(levels: int = 12, width: int = 9) -> str:
    """A list whose aliases expand to width**levels strings (9**12: 2.8e11), in 600 bytes."""
    inner = "&l0 [" + ", ".join(["lol"] * width) + "]"
    for k in range(1, levels):
        inner = f"&l{k} [{inner}" + f", *l{k - 1}" * (width - 1) + "]"
    return inner


def test_a_yaml_alias_bomb_under_train_is_refused_in_one_line(tmp_path, capsys):
    config = job(tmp_path, text=f"name: bomb\nmodel: tiny\ntrain:\n  steps: {bomb()}\n")
    for argv in (["plan", str(config)], ["train", str(config), "--dry-run"]):
        line = one_line(argv, capsys)
        assert f"{config}: line 4 not valid YAML: its aliases expand to more than 100000 values" in line


def test_aliases_that_nest_or_recurse_are_refused():
    with pytest.raises(ConfigError, match="an alias refers to the collection that holds it"):
        parse_yaml("train: &t\n  steps: *t\n", "rec.yaml")
    with pytest.raises(ConfigError, match="rec.yaml: line 1 not valid YAML: nested deeper than 64 levels"):
        parse_yaml("[" * 5000 + "]" * 5000, "rec.yaml")
    chain = "a0: &a0 [1]\n" + "".join(f"a{k}: &a{k} [*a{k - 1}]\n" for k in range(1, 100))
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        parse_yaml(chain, "chain.yaml")


def test_an_integer_past_pythons_digit_limit_is_one_line(tmp_path, capsys):
    line = one_line(["plan", str(job(tmp_path, text=f"name: big\nmodel: tiny\ntrain: {{steps: {'1' * 5000}}}\n"))], capsys)
    assert line.endswith("job.yaml: line 3 not valid YAML: an integer of 5000 digits")


def test_ordinary_aliases_still_load(tmp_path):
    text = ("name: aliased\nmodel: tiny\ndevice: cpu\nstrategy: {dp: 1}\n"
            "train: {steps: &n 2, global_batch_size: 2, micro_batch_size: 1, seq_len: 16, log_every: *n}\n")
    loaded = load_job(job(tmp_path, text=text))
    assert loaded.train.steps == loaded.train.log_every == 2


def test_a_huge_value_in_an_error_is_quoted_short(tmp_path, capsys):
    line = one_line(["plan", str(job(tmp_path, text=yaml.safe_dump({**JOB, "train": {"steps": list(range(50_000))}})))],
                    capsys)
    assert "train.steps: got [0, 1, 2, 3, 4, 5, ...]; expected an integer" in line and len(line) < 400
