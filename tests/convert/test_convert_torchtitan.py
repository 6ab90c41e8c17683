"""torchtitan v0.2.x TOML -> IR: dp_shard = -1, FSDP / HSDP, pipeline splits as torchtitan makes them."""
from pathlib import Path

import pytest

from ms_llm.convert import ConversionError, ReadOptions, dump, load, read
from ms_llm.convert.torchtitan.read import fqn_parts
from ms_llm.job import load_section

FIXTURES = Path(__file__).resolve().parents[2] / "configs" / "examples"    # the peers' configs users convert
LLAMA3 = (FIXTURES / "torchtitan_llama3_8b.toml").read_text()


def _read(text: str, world: int | None = 64):
    return read(text, "llama3_8b.toml", options=ReadOptions(world_size=world))


def test_llama3_8b_preset_on_64_gpus():
    conv = load(FIXTURES / "torchtitan_llama3_8b.toml", options=ReadOptions(world_size=64))
    m, s, t = conv.job.model, conv.job.strategy, conv.job.train
    assert m.name == "llama3_8b" and (m.num_kv_heads, m.ffn_hidden_size, m.rope_theta) == (8, 14336, 500000.0)
    assert (s.dp, s.tp, s.pp, s.zero.stage, s.zero.shard_size) == (64, 1, 1, 3, -1)    # FSDP over all 64
    assert s.recompute.policy == "selective"                                # selective_ac_option = "op"
    assert (s.precision.param_dtype, s.precision.master_dtype, s.precision.grad_reduce_dtype) == \
        ("bfloat16", "float32", "float32")
    assert (t.global_batch_size, t.micro_batch_size, t.seq_len, t.steps) == (64, 1, 8192, 1000)  # local * dp
    assert (t.optimizer.lr, t.optimizer.weight_decay, t.schedule.warmup_steps, t.schedule.decay) == \
        (3e-4, 0.1, 200, "linear")                                          # torchtitan's defaults filled in
    assert t.checkpoint.interval == 0                                       # enable = false
    text = "\n".join(conv.warnings)
    assert "profiling: section not modelled" in text and "training: dataset = 'c4'" in text


def test_dp_shard_minus_one_needs_the_world_size():
    with pytest.raises(ConversionError, match="data_parallel_shard_degree: -1 takes the ranks left over.*--world-size"):
        _read(LLAMA3, world=None)
    with pytest.raises(ConversionError, match="world size 60 is not divisible"):
        _read(LLAMA3.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 8"), world=60)


def test_hsdp_tp_and_explicit_degrees():
    text = LLAMA3.replace("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2") \
        .replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4") \
        .replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 8")
    conv = _read(text, world=None)
    s = conv.job.strategy
    assert conv.world_size == 64 and (s.dp, s.tp, s.zero.stage, s.zero.shard_size) == (8, 8, 3, 4)
    assert s.sequence_parallel                                               # torchtitan's TP plan shards norms
    with pytest.raises(ConversionError,
                       match=r"replicate\*shard\*cp\*tp\*pp = 2\*4\*1\*8\*1 = 64, but the world size is 32"):
        _read(text, world=32)


def test_pipeline_split_follows_torchtitan():
    assert fqn_parts(4, 32) == [8, 9, 8, 7]          # embedding and output each weigh one layer
    assert fqn_parts(2, 32) == [16, 16]
    assert fqn_parts(8, 32) == [4, 5, 4, 4, 4, 4, 4, 3]
    text = LLAMA3.replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 4\n"
                          'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_microbatch_size = 2') \
        .replace("local_batch_size = 1", "local_batch_size = 16")
    s = _read(text).job.strategy
    assert (s.pp, s.pipeline.schedule, s.pipeline.virtual_stages) == (4, "interleaved_1f1b", 2)   # 2 per rank
    assert s.pipeline.layer_split == (4, 5, 4, 4, 4, 4, 4, 3)
    conv = _read(text)
    assert (conv.job.train.micro_batch_size, conv.job.train.global_batch_size) == (2, 16 * 16)


def test_module_fqns_and_every_nth_layer_recompute():
    parts = [["tok_embeddings"] + [f"layers.{i}" for i in range(16)], [f"layers.{i}" for i in range(16, 32)] +
             ["norm", "output"]]
    fqns = f"pipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {parts!r}".replace("'", '"')
    text = LLAMA3.replace("pipeline_parallel_degree = 1", fqns) \
        .replace('selective_ac_option = "op"', 'selective_ac_option = "2"') \
        .replace("local_batch_size = 1", "local_batch_size = 4")
    s = _read(text).job.strategy
    assert s.pipeline.layer_split is None                                    # [16, 16] is the even split
    assert (s.recompute.policy, s.recompute.num_layers) == ("full", 8)      # one layer in 2 of each 16-layer stage
    bad = text.replace('"layers.16", ', "")
    with pytest.raises(ConversionError, match="module_fqns_per_model_part: part 1 holds layers"):
        _read(bad)


def test_unknown_flavor_and_bad_toml():
    with pytest.raises(ConversionError, match=r"model.flavor: llama3 / '405B' .* --model"):
        _read(LLAMA3.replace('flavor = "8B"', 'flavor = "405B"'))
    with pytest.raises(ConversionError, match="llama3_8b.toml: not valid TOML"):
        _read("[training\nseq_len = 1")


def test_torchtitan_03_job_as_written_by_hand():
    """A 0.3 job: registered config + tyro overrides (dashes or underscores, boolean flags, the
    activation-checkpoint subcommand), launched by torchrun -m; values it leaves out are named."""
    script = """#!/bin/bash
NGPU=${NGPU:-16}
torchrun --nproc_per_node=$NGPU -m torchtitan.train --module=llama3 --config llama3_8b \\
    --parallelism.tensor-parallel-degree 2 --parallelism.pipeline_parallel_degree 2 \\
    --training.local_batch_size 8 --training.seq_len 8192 --training.steps 100 \\
    --optimizer.param_groups.0.optimizer_kwargs.lr 2e-4 --optimizer.param_groups.0.optimizer_kwargs.betas 0.9 0.95 \\
    --checkpoint.enable --checkpoint.interval 50 --compile.no-enable activation_checkpoint:full
"""
    conv = read(script, "job.sh")
    s, t = conv.job.strategy, conv.job.train
    assert conv.world_size == 16 and (s.dp, s.tp, s.pp) == (4, 2, 2)          # shard -1 takes the rest
    assert (t.seq_len, t.steps, t.optimizer.lr, t.checkpoint.interval) == (8192, 100, 2e-4, 50)
    assert s.recompute.policy == "full" and conv.job.model == load_section("model", "llama3_8b")
    assert any("lr_scheduler.warmup_steps" in w and "registry" in w for w in conv.warnings)
    back = read(dump(conv, "torchtitan").text, "job.sh")
    assert (back.job.strategy, back.job.train) == (s, t)
    with pytest.raises(ConversionError, match="needs --module and --config"):
        read("--config llama3_8b --training.steps 3\n", "x.args", "torchtitan")
