"""`--set PATH=VALUE` and `--model NAME` on `plan` and `train`: set in the job's mapping before it
is checked, so a bad one gets the error the same line in the YAML would; recorded in the run's
config.yaml."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ms_llm.errors import ConfigError, StrategyError
from ms_llm.job import load_job, parse_overrides
from ms_llm.launch import TrainRequest, prepare
from ms_llm.strategy.plan import plan

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "configs/train/tiny_torch_dp2.yaml"        # model: tiny and strategy: dp2, both by reference


def load(*sets: str, model: str | None = None, path: Path = JOB):
    return load_job(path, parse_overrides(sets, model))


def ms_llm(*args):
    return subprocess.run([sys.executable, "-m", "ms_llm", *args], capture_output=True, text=True, cwd=ROOT)


def test_values_are_read_as_yaml_and_typed_by_the_field():
    job = load("train.steps=100", "train.optimizer.lr=0.01", "model.tie_embeddings=true", "name=run.7",
               "train.data.paths=[a, b]", "train.data.weights=[1, 3]", "device=h100")
    t = job.train
    assert (t.steps, t.optimizer.lr, job.model.tie_embeddings, job.name, job.device) == (100, 0.01, True, "run.7",
                                                                                          "h100")
    assert t.data.paths == ("a", "b") and t.data.weights == (1.0, 3.0)
    assert t.seq_len == 128 and t.optimizer.weight_decay == 0.0       # the rest of the file stays


def test_overrides_reach_into_sections_given_by_reference_and_nested_fields():
    job = load("strategy.tp=2", "strategy.zero.stage=3", "model.num_layers=2", "train.checkpoint.interval=5",
               "model.moe.num_experts=4")
    s = job.strategy
    assert (s.dp, s.tp, s.zero.stage) == (2, 2, 3)                    # dp from configs/strategies/dp2.yaml
    assert (job.model.num_layers, job.model.hidden_size) == (2, load().model.hidden_size)
    assert job.model.moe.num_experts == 4 and job.train.checkpoint.interval == 5
    assert load("strategy.zero={stage: 2, shard_size: 2}").strategy.zero.stage == 2   # a section whole
    assert load("train.steps=1", "train.steps=2").train.steps == 2                    # the last one wins


def test_model_names_the_model_of_a_job_without_one_or_replaces_it(tmp_path):
    bare = tmp_path / "job.yaml"
    bare.write_text(yaml.safe_dump({"name": "bare", "strategy": {"dp": 1}, "train": {"global_batch_size": 4}}))
    with pytest.raises(ConfigError, match="model: missing"):
        load(path=bare)
    assert load(model="tiny", path=bare).model == load().model
    assert load("model.num_layers=3", model="tiny_moe").model.moe is not None
    assert load("model.num_layers=3", model="tiny_moe").model.num_layers == 3     # --model first, then --set
    assert load(model=str(ROOT / "configs/models/tiny_moe.yaml")).model == load(model="tiny_moe").model
    with pytest.raises(ConfigError, match=r"^--model nope: model: 'nope' is neither a file nor a name in "
                                          r"configs/models \(known: .*tiny"):
        load(model="nope")


@pytest.mark.parametrize("text,match", [
    ("modle.num_layers=2", "modle: unknown key; did you mean 'model'?"),
    ("strategy.zzz=1", "strategy.zzz: unknown key; known keys: dp, tp, pp, cp"),
    ("train.chekpoint.interval=5", "train.chekpoint: unknown key; did you mean 'checkpoint'?"),
    ("train.steps=many", "train.steps: got 'many'; expected an integer"),
    ("strategy.zero.stage=1.5", "strategy.zero.stage: got 1.5; expected an integer"),
    ("model.num_layers=0", "model.num_layers: got 0; must be >= 1"),
    ("backend=jax", "backend: got 'jax'; allowed: 'torch' | 'mindspore'"),
])
def test_a_bad_path_or_value_gets_the_yamls_error_naming_the_file_and_flag(text, match):
    with pytest.raises(ConfigError) as err:
        load(text)
    assert str(err.value).startswith(f"{JOB} with --set {text}: ") and match in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text,match", [
    ("train.steps", r"^--set train.steps: no '='; write PATH=VALUE"),
    ("=3", r"^--set =3: '' is not a dotted key path"),
    ("train..steps=1", r"^--set train..steps=1: 'train..steps' is not a dotted key path"),
    ("train.steps=[1", r"^--set 'train.steps=\[1': line 1 not valid YAML"),
])
def test_a_malformed_set_is_refused_before_the_job_is_read(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides([text])


@pytest.mark.parametrize("text,path", [("train.steps.x=1", "train.steps"), ("name.x=1", "name"),
                                       ("train.checkpoint.interval.x=1", "train.checkpoint.interval")])
def test_a_path_into_a_value_names_the_value(text, path):
    with pytest.raises(ConfigError, match=rf"^--set {text}: {path}: a value, not a section with keys; set it "
                                          rf"whole: --set {path}=VALUE$"):
        load(text)


def test_an_override_the_plan_cannot_run_gets_the_plans_error():
    job = load("strategy.cp=3")
    with pytest.raises(StrategyError, match="strategy.cp: no context-parallel algorithm fits"):
        plan(job.model, job.strategy, job.train)


def test_the_run_folder_config_holds_the_overrides_and_loads_again(tmp_path):
    overrides = parse_overrides(["train.steps=2", "strategy.zero.stage=1", "model.name=with spaces"], "tiny")
    job, _, run = prepare(TrainRequest(JOB, run_dir=tmp_path / "run", overrides=overrides))
    text = run.config.read_text()
    assert text.splitlines()[0] == ("# overrides, applied below: --model tiny --set train.steps=2 "
                                    "--set strategy.zero.stage=1 --set 'model.name=with spaces'")
    back = load_job(run.config)
    assert back == job and (back.train.steps, back.strategy.zero.stage, back.model.name) == (2, 1, "with spaces")


def test_plan_prints_the_changed_plan():
    out = ms_llm("plan", str(JOB), "--set", "strategy.zero.stage=2", "--set", "train.global_batch_size=16")
    assert out.returncode == 0, out.stderr
    assert "dp2 (zero-2, shard 2)" in out.stdout and "batch      global 16 = micro 2 x dp 2 x 4" in out.stdout


def test_train_dry_run_lowers_the_changed_job_and_writes_nothing(tmp_path):
    out = ms_llm("train", str(JOB), "--set", "train.steps=2", "--set", "strategy.zero.stage=1", "--dry-run",
                 "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "ZeRO 1" in out.stdout and "nothing launched" in out.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,args,line", [
    ("plan", ["--set", "strategy.zzz=1"], "strategy.zzz: unknown key"),
    ("plan", ["--set", "strategy.cp=3"], "strategy.cp: no context-parallel algorithm fits"),
    ("plan", ["--set", "train.steps"], "--set train.steps: no '='"),
    ("train", ["--set", "train.steps=-1", "--dry-run"], "train.steps: got -1; must be >= 0"),
    ("train", ["--model", "nope", "--dry-run"], "--model nope: model: 'nope' is neither a file"),
])
def test_errors_are_one_line_without_a_traceback(command, args, line):
    out = ms_llm(command, str(JOB), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and line in out.stderr, out.stderr
