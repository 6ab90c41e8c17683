"""X -> ms_llm -> X keeps every IR field; every cross conversion either keeps a field or says so in
a warning; cross conversions produce what a practitioner would write by hand."""
import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest
import yaml

from ms_llm.config.schema import to_dict
from ms_llm.job import job_from_dict, load_job, load_section
from ms_llm.convert import (FORMATS, ConversionError, ReadOptions, convert, detect_format, dump, from_job, load,
                            read)
from ms_llm.convert.common import flatten
from ms_llm.convert.megatron.read import parse_args
from ms_llm.convert.shell import launch_command

FIXTURES = Path(__file__).resolve().parents[2] / "configs" / "examples"    # the peers' configs users convert
SUFFIX = {"ms_llm": ".yaml", "megatron": ".sh", "deepspeed": ".json", "mindformers": ".yaml", "mindformers2": ".yaml",
          "torchtitan": ".sh", "torchtitan_toml": ".toml"}
SOURCES = {
    "megatron_gpt3_175b.sh": ReadOptions(),
    "megatron_llama3_8b.sh": ReadOptions(),
    "mindformers_r1_llama2_7b.yaml": ReadOptions(),
    "mindformers_r1_llama2_70b.yaml": ReadOptions(),
    "torchtitan_llama3_8b.toml": ReadOptions(world_size=64),
    "deepspeed_zero3_offload.json": ReadOptions(model=load_section("model", "llama2_7b")),
}
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "train").glob("*.yaml"))


def ir(conv) -> dict:
    """Every IR field (model, strategy, train), defaults included; the model's name and dtype aside
    (a name is a label; dtype follows strategy.precision.param_dtype)."""
    job = conv.job
    out = flatten({"model": to_dict(job.model, full=True), "strategy": to_dict(job.strategy, full=True),
                   "train": to_dict(job.train, full=True)})
    out.pop("model.name")
    out.pop("model.dtype")
    return out


def differences(a: dict, b: dict) -> dict:
    def same(x, y):
        return math.isclose(x, y, rel_tol=1e-12) if isinstance(x, float) and isinstance(y, float) else x == y
    return {k: (a[k], b.get(k)) for k in a if not same(a[k], b.get(k))}


def reread(conv, fmt):
    out = dump(conv, fmt)
    back = read(out.text, "converted" + SUFFIX[fmt], fmt, ReadOptions(world_size=conv.world_size, model=conv.job.model))
    return out, back


@pytest.mark.parametrize("name", SOURCES)
def test_x_to_ms_llm_to_x_keeps_every_field(name):
    conv = load(FIXTURES / name, options=SOURCES[name])
    fmt = detect_format((FIXTURES / name).read_text(), name)
    _, as_ms_llm = reread(conv, "ms_llm")
    assert differences(ir(conv), ir(as_ms_llm)) == {}
    _, back = reread(as_ms_llm, fmt)
    assert differences(ir(conv), ir(back)) == {}
    assert back.world_size == conv.world_size


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
@pytest.mark.parametrize("fmt", FORMATS)
def test_shipped_jobs_survive_every_format_or_warn(path, fmt):
    job = load_job(path)
    world = None if job.strategy.dp > 0 else 1024
    conv = from_job(job, world, str(path))
    out, back = reread(conv, fmt)
    _assert_explained(differences(ir(conv), ir(back)), out.warnings, f"{path.stem} -> {fmt}")


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cross_conversions_keep_or_warn(name, fmt):
    conv = load(FIXTURES / name, options=SOURCES[name])
    out, back = reread(conv, fmt)
    _assert_explained(differences(ir(conv), ir(back)), out.warnings, f"{name} -> {fmt}")


def _assert_explained(diff: dict, warnings: list[str], what: str) -> None:
    """Every IR field that changed is named (or its section is) in a writer warning."""
    for path in diff:
        parts = path.split(".")
        names = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
        assert any(n in w for w in warnings for n in names), f"{what}: {path} changed {diff[path]} silently"


def test_mindformers_70b_to_megatron_is_what_one_would_write():
    text, warnings = convert(FIXTURES / "mindformers_r1_llama2_70b.yaml", "megatron")
    launch = launch_command(text, "out.sh")
    assert launch.launcher[:5] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "8"]
    args = parse_args(launch.args, "out.sh")
    assert {k: args[k] for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                                 "--global-batch-size", "--num-query-groups", "--ffn-hidden-size", "--seq-length")} == \
        {"--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "8", "--micro-batch-size": "1",
         "--global-batch-size": "256", "--num-query-groups": "8", "--ffn-hidden-size": "28672", "--seq-length": "4096"}
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--fp16", "--swiglu", "--group-query-attention",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert args[flag] is True
    assert "--bf16" not in args and "--num-layers-per-virtual-pipeline-stage" not in args
    assert any("float32 main weights" in w for w in warnings)       # MindFormers' fp16 params have no fp32 copy


def test_deepspeed_to_torchtitan_is_what_one_would_write():
    text, warnings = convert(FIXTURES / "deepspeed_zero3_offload.json", "torchtitan_toml",
                             options=ReadOptions(model=load_section("model", "llama3_8b")))
    toml = tomllib.loads(text)
    assert toml["model"] == {"name": "llama3", "flavor": "8B"}
    assert toml["parallelism"]["data_parallel_shard_degree"] == -1 and \
        toml["parallelism"]["data_parallel_replicate_degree"] == 1
    assert {k: toml["training"][k] for k in ("local_batch_size", "global_batch_size", "enable_cpu_offload",
                                             "mixed_precision_param", "max_norm")} == \
        {"local_batch_size": 2, "global_batch_size": 64, "enable_cpu_offload": True,
         "mixed_precision_param": "bfloat16", "max_norm": 1.0}
    assert toml["lr_scheduler"] == {"warmup_steps": 2000, "decay_type": "cosine", "min_lr_factor": 0.1}
    assert toml["activation_checkpoint"] == {"mode": "none"}
    assert any("grad_reduce_dtype = bfloat16" in w for w in warnings)   # DeepSpeed reduced in bf16


def test_torchtitan_to_deepspeed_is_what_one_would_write():
    text, warnings = convert(FIXTURES / "torchtitan_llama3_8b.toml", "deepspeed", options=ReadOptions(world_size=64))
    ds = json.loads(text)
    batch = (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"])
    assert batch == (64, 1, 1)
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True}
    assert ds["communication_data_type"] == "fp32" and ds["gradient_clipping"] == 1.0
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.1}}
    assert ds["scheduler"]["type"] == "WarmupDecayLR" and ds["scheduler"]["params"]["total_num_steps"] == 1000
    assert any("selective" in w for w in warnings)


def test_megatron_to_mindformers_is_what_one_would_write():
    text, _ = convert(FIXTURES / "megatron_gpt3_175b.sh", "mindformers")
    mf = yaml.safe_load(text)
    assert mf["parallel_config"] == {"data_parallel": 8, "model_parallel": 8, "context_parallel": 1,
                                     "pipeline_stage": 16, "expert_parallel": 1, "use_seq_parallel": False,
                                     "micro_batch_num": 192, "vocab_emb_dp": False}
    assert mf["parallel"]["enable_parallel_optimizer"] is False
    mc = mf["model"]["model_config"]
    assert (mc["compute_dtype"], mc["param_init_type"], mc["intermediate_size"]) == ("float16", "float32", 32768)
    assert mf["runner_wrapper"]["scale_sense"]["type"] == "DynamicLossScaleUpdateCell"
    assert mf["runner_config"]["batch_size"] == 1


def test_strict_turns_warnings_into_an_error():
    with pytest.raises(ConversionError, match=r"--strict and \d+ thing\(s\) would not carry over"):
        convert(FIXTURES / "megatron_llama3_8b.sh", "deepspeed", strict=True)
    for fmt in ("torchtitan", "torchtitan_toml"):
        _, warnings = convert(FIXTURES / "torchtitan_llama3_8b.toml", fmt, options=ReadOptions(world_size=64))
        assert all(w.startswith("read:") for w in warnings)      # nothing lost on the write side


def test_detection():
    assert detect_format("", "x.json") == "deepspeed" and detect_format("", "x.toml") == "torchtitan"
    assert detect_format("torchrun -m torchtitan.train --module llama3 --config llama3_8b\n", "x.sh") == "torchtitan"
    assert detect_format("parallel_config: {data_parallel: 8}\n", "x.yaml") == "mindformers"
    assert detect_format("model: llama2_7b\nstrategy: dp8_zero1\n", "x.yaml") == "ms_llm"
    assert detect_format("--tensor-model-parallel-size 2\n", "args") == "megatron"
    with pytest.raises(ConversionError, match="x.yaml: cannot tell which format.*--from"):
        detect_format("foo: 1\n", "x.yaml")


def test_cp_sequence_parallel_and_flash_attention_cross_mindformers_and_megatron():
    """MindFormers dp2*mp2*cp2 with use_seq_parallel and use_flash_attention -> Megatron
    (--context-parallel-size, --sequence-parallel, --attention-backend flash) -> MindFormers keeps all."""
    text = (FIXTURES / "mindformers_r1_llama2_7b.yaml").read_text().replace("  data_parallel: 8", "  data_parallel: 2") \
        .replace("  model_parallel: 1", "  model_parallel: 2\n  context_parallel: 2") \
        .replace("  use_seq_parallel: False", "  use_seq_parallel: True")
    conv = read(text, "7b_cp2_sp.yaml")
    script, as_megatron = reread(conv, "megatron")
    args = parse_args(launch_command(script.text, "out.sh").args, "out.sh")
    assert (args["--context-parallel-size"], args["--sequence-parallel"], args["--attention-backend"]) == \
        ("2", True, "flash")
    _, back = reread(as_megatron, "mindformers")
    for job in (as_megatron.job, back.job):
        assert (job.strategy.cp, job.strategy.tp, job.strategy.sequence_parallel, job.model.flash_attention) == \
            (2, 2, True, True)


@pytest.mark.parametrize("flags,flash,warned", [
    ("--attention-backend flash", True, False), ("--use-flash-attn", True, False),
    ("--attention-backend unfused", False, False), ("--attention-backend fused", False, True),
    ("--attention-backend auto", False, True), ("", False, False)])
def test_megatron_flash_attention_flags(flags, flash, warned):
    """--attention-backend flash and the legacy --use-flash-attn read as model.flash_attention; auto and
    fused (kernels Megatron or cuDNN pick) read as plain attention, with a warning."""
    base = (FIXTURES / "megatron_llama3_8b.sh").read_text()
    conv = read(base.replace("    --attention-backend fused", f"    {flags}"), "llama3_8b.sh", "megatron")
    assert conv.job.model.flash_attention is flash
    assert not any("dropped" in w and ("--attention-backend" in w or "--use-flash-attn" in w)
                   for w in conv.warnings)                                         # every spelling is read
    assert any(w.startswith("--attention-backend") for w in conv.warnings) is warned


def test_flash_attention_to_torchtitan_is_reported_not_dropped():
    text, warnings = convert(FIXTURES / "mindformers_r1_llama2_7b.yaml", "torchtitan", options=ReadOptions(world_size=8))
    assert "flash" not in text
    assert "write: model.flash_attention = True: torchtitan's attention is SDPA, which picks the flash kernel itself; " \
        "no field written" in warnings


# Every model.moe field away from its default, on the tiny model (q/k norms: MindFormers 2.x's MoE model has them).
MOE = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 32, "shared_experts": 1, "normalize_top_k": False,
       "capacity_factor": 1.5, "aux_loss_coeff": 0.02, "z_loss_coeff": 0.001, "first_dense_layers": 1}
ALGORITHMS = ("ring", "ulysses", "allgather")
# The algorithms each format names (DeepSpeed runs Ulysses; torchtitan 0.3 gathers K/V, v0.2.x also rings) and
# the formats whose files hold model.moe (DeepSpeed and torchtitan take the model from --model / the flavor).
NAMES_CP = {"ms_llm": ALGORITHMS, "megatron": ALGORITHMS, "mindformers": ALGORITHMS, "mindformers2": ALGORITHMS,
            "deepspeed": ("ulysses",), "torchtitan": ("allgather",), "torchtitan_toml": ("ring", "allgather")}
HOLDS_MOE = ("ms_llm", "megatron", "mindformers", "mindformers2")


def _moe_cp_job(algorithm: str):
    job = load_job(Path(__file__).resolve().parents[2] / "configs" / "train" / "tiny_torch_dp2.yaml")
    model = {**to_dict(job.model), "moe": MOE, "qk_norm": True, "flash_attention": True}
    strategy = {"dp": 2, "cp": 2, "ep": 2, "context_parallel": {"algorithm": algorithm}}
    data = {"name": "moe_cp", "model": model, "strategy": strategy, "train": to_dict(job.train), "device": "h100"}
    return from_job(job_from_dict(data), 4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cp_algorithm_and_moe_survive_or_are_named(fmt, algorithm):
    """Each format keeps the context-parallel algorithm and model.moe where it can say them, and
    names them in a warning where it cannot."""
    conv = _moe_cp_job(algorithm)
    out = dump(conv, fmt)
    given = None if fmt in HOLDS_MOE else conv.job.model        # read the file's own model where it has one
    back = read(out.text, "converted" + SUFFIX[fmt], fmt, ReadOptions(world_size=4, model=given))
    s = back.job.strategy
    assert (s.cp, s.ep) == (2, 2)
    named = [w for w in out.warnings if "strategy.context_parallel.algorithm" in w]
    assert (s.context_parallel.algorithm == algorithm) is (algorithm in NAMES_CP[fmt]) is not bool(named)
    if fmt in HOLDS_MOE:
        # MindFormers' LLaMA (r1.x) and Qwen3MoeForCausalLM (2.x) make every layer MoE
        want = dataclasses.replace(conv.job.model.moe, first_dense_layers=0) if fmt.startswith("mindformers") else \
            conv.job.model.moe
        assert back.job.model.moe == want
    _assert_explained(differences(ir(conv), ir(back)), out.warnings, f"moe cp {algorithm} -> {fmt}")


def test_auto_cp_algorithm_is_written_as_the_cost_models_pick():
    conv = _moe_cp_job("auto")
    out = dump(conv, "megatron")
    pick = next(w for w in out.warnings if w.startswith("strategy.context_parallel.algorithm = auto"))
    algorithm = read(out.text, "x.sh", "megatron", ReadOptions(world_size=4)).job.strategy.context_parallel.algorithm
    assert algorithm in ALGORITHMS and f", {algorithm}, is written" in pick
