"""Job YAML loading: every shipped config round-trips; every bad value names its key path."""
from pathlib import Path

import pytest
import yaml

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, to_dict
from ms_llm.errors import ConfigError, StrategyError
from ms_llm.job import CONFIG_ROOT, dump_yaml, job_from_dict, job_to_dict, load_job, load_section
from ms_llm.strategy.ir import ParallelStrategy

TRAIN_FILES = sorted((CONFIG_ROOT / "train").glob("*.yaml"))
STRATEGY_FILES = sorted((CONFIG_ROOT / "strategies").glob("*.yaml"))
MODEL_FILES = sorted((CONFIG_ROOT / "models").glob("*.yaml"))


def test_shipped_models_have_the_published_sizes():
    sizes = {p.stem: load_section("model", p.stem).num_params() / 1e9 for p in MODEL_FILES}
    assert 6.6 < sizes["llama2_7b"] < 6.8
    assert 12.9 < sizes["llama2_13b"] < 13.1
    assert 68.8 < sizes["llama2_70b"] < 69.1
    assert 7.9 < sizes["llama3_8b"] < 8.1
    assert 70.4 < sizes["llama3_70b"] < 70.7
    assert 174 < sizes["gpt3_175b"] < 176
    assert 1e-3 < sizes["tiny"] < 1e-2
    # The Hugging Face shapes summed (q/k/v biases, q/k norms, head_dim 128); the model cards say 7.62B, 8.19B, 32.8B.
    assert load_section("model", "qwen2_7b").num_params() == 7_615_616_512
    assert load_section("model", "qwen3_8b").num_params() == 8_190_735_360
    assert load_section("model", "qwen3_32b").num_params() == 32_762_123_264


@pytest.mark.parametrize("path", TRAIN_FILES, ids=lambda p: p.stem)
def test_job_yaml_ir_yaml_is_identity(path, tmp_path):
    job = load_job(path)
    text = dump_yaml(job_to_dict(job))
    again = tmp_path / "job.yaml"
    again.write_text(text)
    assert load_job(again) == job
    assert dump_yaml(job_to_dict(load_job(again))) == text


@pytest.mark.parametrize("path", STRATEGY_FILES, ids=lambda p: p.stem)
def test_strategy_file_round_trip_is_identity(path):
    data = yaml.safe_load(path.read_text())
    assert to_dict(from_dict(ParallelStrategy, data)) == data


def test_full_dump_reads_back():
    s = ParallelStrategy(dp=4, tp=2, sequence_parallel=True)
    assert from_dict(ParallelStrategy, to_dict(s, full=True)) == s


def bad(data: dict, match: str, exc=ConfigError):
    base = {"model": "tiny"}
    with pytest.raises(exc, match=match):
        job_from_dict({**base, **data})


def test_unknown_key_suggests_the_near_one():
    bad({"strategy": {"pipeline": {"micro_batchs": 4}}}, r"strategy\.pipeline\.micro_batchs: unknown key; did you mean 'micro_batches'")
    bad({"stratgy": {}}, r"stratgy: unknown key; did you mean 'strategy'")


def test_wrong_types_and_ranges_name_the_path():
    bad({"strategy": {"pipeline": {"micro_batches": "four"}}}, r"strategy\.pipeline\.micro_batches: got 'four'; expected an integer")
    bad({"strategy": {"tp": 0}}, r"strategy\.tp: got 0; must be >= 1")
    bad({"strategy": {"zero": {"stage": 4}}}, r"strategy\.zero\.stage: got 4; must be <= 3")
    bad({"strategy": {"pipeline": {"schedule": "1F1B"}}}, r"strategy\.pipeline\.schedule: got '1F1B'; allowed: 'gpipe'")
    bad({"strategy": {"sequence_parallel": "yes"}}, r"strategy\.sequence_parallel: got 'yes'; expected true or false")
    bad({"train": {"optimizer": {"beta2": 1.5}}}, r"train\.optimizer\.beta2: got 1.5; must be <= 1.0")
    bad({"train": {"checkpoint": {"interval": "often"}}}, r"train\.checkpoint\.interval: got 'often'")
    bad({"strategy": {"pipeline": {"layer_split": [2, "x"]}}}, r"strategy\.pipeline\.layer_split\[1\]: got 'x'")
    bad({"strategy": [1, 2]}, r"strategy: got \[1, 2\]; expected a mapping")
    bad({"strategy": {"dp": 0}}, r"strategy\.dp: 0", StrategyError)


def test_missing_required_field():
    with pytest.raises(ConfigError, match=r"model\.hidden_size: missing"):
        job_from_dict({"model": {"vocab_size": 10, "num_layers": 1, "num_heads": 1, "ffn_hidden_size": 4}})
    with pytest.raises(ConfigError, match="model: missing"):
        job_from_dict({"strategy": {}})


def test_model_consistency_errors():
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads: 3 must divide model\.num_heads=8"):
        ModelConfig(vocab_size=8, hidden_size=64, num_layers=1, num_heads=8, num_kv_heads=3, ffn_hidden_size=8)
    with pytest.raises(ConfigError, match=r"model\.hidden_size: 66 is not divisible"):
        ModelConfig(vocab_size=8, hidden_size=66, num_layers=1, num_heads=8, ffn_hidden_size=8)
    assert ModelConfig(vocab_size=8, hidden_size=66, num_layers=1, num_heads=8, ffn_hidden_size=8, head_dim=16).q_dim == 128
    base = {"vocab_size": 8, "hidden_size": 64, "num_layers": 1, "num_heads": 8, "ffn_hidden_size": 8}
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.original_max_seq_len: required by type 'llama3'"):
        from_dict(ModelConfig, {**base, "rope_scaling": {"type": "llama3", "factor": 8.0}}, "model")
    with pytest.raises(ConfigError, match=r"model\.max_seq_len: 4096 exceeds rope_scaling\.original_max_seq_len=2048"):
        from_dict(ModelConfig, {**base, "max_seq_len": 4096,
                                "rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_seq_len": 2048}}, "model")


def test_references_resolve_relative_then_by_name(tmp_path):
    (tmp_path / "my_strategy.yaml").write_text("dp: 2\ntp: 2\n")
    (tmp_path / "job.yaml").write_text("model: tiny\nstrategy: my_strategy.yaml\n")
    job = load_job(tmp_path / "job.yaml")
    assert job.strategy.tp == 2 and job.model.name == "tiny"
    (tmp_path / "broken.yaml").write_text("model: tiny\nstrategy: {dp: [\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: line \d+ not valid YAML"):
        load_job(tmp_path / "broken.yaml")
    (tmp_path / "badref.yaml").write_text("model: tiny\nstrategy: nope\n")
    with pytest.raises(ConfigError, match=r"strategy: 'nope' is neither a file nor a name in configs/strategies \(known: .*dp2"):
        load_job(tmp_path / "badref.yaml")
    (tmp_path / "bad_strategy.yaml").write_text("dp: 2\ntpp: 2\n")
    (tmp_path / "job2.yaml").write_text("model: tiny\nstrategy: bad_strategy.yaml\n")
    with pytest.raises(ConfigError, match=r"bad_strategy\.yaml: strategy\.tpp: unknown key; did you mean 'tp'"):
        load_job(tmp_path / "job2.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        load_job(tmp_path / "absent.yaml")


def test_yaml_is_read_safely(tmp_path):
    (tmp_path / "evil.yaml").write_text("model: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(tmp_path / "evil.yaml")


@pytest.mark.parametrize("moe,message", [
    ({"num_experts": 4, "top_k": 5}, r"^model\.moe\.top_k: 5 exceeds model\.moe\.num_experts=4$"),
    ({"num_experts": 4, "capacity_factor": 0}, r"^model\.moe\.capacity_factor: got 0.0; use a positive factor"),
    ({"num_experts": 4, "first_dense_layers": 2}, r"^model\.moe\.first_dense_layers: 2 leaves no MoE layer"),
    ({"num_experts": 0}, r"^model\.moe\.num_experts: got 0; must be >= 1$"),
    ({"num_experts": 4, "topk": 2}, r"^model\.moe\.topk: unknown key; did you mean 'top_k'\?$"),
])
def test_moe_config_errors_name_the_field(moe, message):
    tiny = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 64}
    with pytest.raises(ConfigError, match=message):
        from_dict(ModelConfig, {**tiny, "moe": moe}, "model")


def test_moe_section_and_the_keys_older_configs_used():
    """model.moe is the one way to say MoE; the flat keys older configs used name where they moved."""
    tiny = {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 64}
    full = from_dict(ModelConfig, {**tiny, "moe": {"num_experts": 8, "layer_freq": 2, "first_dense_layers": 1}})
    assert full.moe.num_experts == 8 and full.moe_layers == (2,)
    assert from_dict(ModelConfig, to_dict(full)) == full
    for key, moved in (("num_experts", "moe.num_experts"), ("moe_top_k", "moe.top_k")):
        with pytest.raises(ConfigError, match=rf"^model\.{key}: this key moved to model\.{moved}; write it there$"):
            from_dict(ModelConfig, {**tiny, key: 4}, "model")
