"""train.optimizer.weight_decay_1d from and to the peers' configs: Megatron-LM and MindFormers exempt
biases and 1-D parameters (false), torchtitan decays every parameter (true), a DeepSpeed config does
not say (its training script's param groups do: read as true); a writer that cannot say the job's
value warns, naming the field."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from ms_llm.convert import ReadOptions, dump, from_job, load, read
from ms_llm.job import load_job, load_section

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "configs" / "examples"
PYNATIVE = ROOT / ".oracles" / "configs" / "deepseek3" / "pretrain_deepseek3_1b_8p_pynative.yaml"
FIELD = "train.optimizer.weight_decay_1d"


@pytest.mark.parametrize("path,options,decays_1d", [
    (FIXTURES / "megatron_gpt3_175b.sh", ReadOptions(), False),
    (FIXTURES / "mindformers_r1_llama2_7b.yaml", ReadOptions(), False),
    (FIXTURES / "mindformers2_llama2_7b.yaml", ReadOptions(), False),
    (PYNATIVE, ReadOptions(world_size=8), False),
    (FIXTURES / "torchtitan_llama3_8b.toml", ReadOptions(world_size=64), True),
    (FIXTURES / "deepspeed_zero3_offload.json", ReadOptions(model=load_section("model", "llama2_7b")), True),
], ids=lambda v: v.stem if isinstance(v, Path) else "")
def test_read(path, options, decays_1d):
    conv = load(path, options=options)
    assert conv.job.train.optimizer.weight_decay_1d is decays_1d
    assert not any(FIELD in w for w in conv.warnings)


@pytest.mark.parametrize("decays_1d,silent,warned", [
    (True, ("deepspeed", "torchtitan", "torchtitan_toml"), ("megatron", "mindformers", "mindformers2")),
    (False, ("megatron", "mindformers", "mindformers2"), ("deepspeed", "torchtitan", "torchtitan_toml")),
])
def test_writers_say_what_they_cannot_write(decays_1d, silent, warned):
    job = load_job(ROOT / "configs" / "train" / "llama2_7b_dp8_zero1.yaml")
    opt = dataclasses.replace(job.train.optimizer, weight_decay_1d=decays_1d)
    conv = from_job(dataclasses.replace(job, train=dataclasses.replace(job.train, optimizer=opt)), None)
    for fmt in silent + warned:
        hits = [w for w in dump(conv, fmt).warnings if w.startswith(f"{FIELD} = {str(decays_1d).lower()}")]
        assert len(hits) == (fmt in warned), (fmt, hits)


@pytest.mark.parametrize("extra,warned", [("--qk-layernorm", True), ("", False)])
def test_megatron_apply_wd_to_qk_layernorm(extra, warned):
    """Megatron then decays its q/k layernorm weights alone among the 1-D parameters: said where the
    model has them, silent (and read, not 'dropped') where it has none."""
    script = (FIXTURES / "megatron_llama3_8b.sh").read_text()
    assert script.count("    --attention-backend fused") == 1
    flags = f"--attention-backend fused --apply-wd-to-qk-layernorm {extra}"
    script = script.replace("    --attention-backend fused", f"    {flags}")
    conv = read(script, "llama3_8b.sh", "megatron")
    assert conv.job.train.optimizer.weight_decay_1d is False
    assert conv.job.model.qk_norm is warned
    notes = [w for w in conv.warnings if "--apply-wd-to-qk-layernorm" in w]
    assert len(notes) == warned and all(FIELD in n for n in notes), notes


@pytest.mark.parametrize("include,exclude,decays_1d,warned", [
    (["*"], None, True, None), (["*"], ["embed"], True, None),
    (["norm"], None, False, "weight_decay_include ['norm']"), (None, ["embed"], False, "weight_decay_exclude"),
])
def test_mindformers_pynative_decay_rules(include, exclude, decays_1d, warned):
    """get_param_groups' weight_decay_include (wins) / weight_decay_exclude: '*' decays every parameter;
    a rule by name is said not modelled."""
    data = yaml.safe_load(PYNATIVE.read_text())
    data["optimizer"].update({k: v for k, v in (("weight_decay_include", include), ("weight_decay_exclude", exclude))
                              if v is not None})
    conv = read(yaml.safe_dump(data), "pynative.yaml", "mindformers", ReadOptions(world_size=8))
    assert conv.job.train.optimizer.weight_decay_1d is decays_1d
    notes = [w for w in conv.warnings if "weight_decay_include" in w or "weight_decay_exclude" in w]
    assert [warned in n for n in notes] == ([True] if warned else []), notes
