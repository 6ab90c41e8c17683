"""DeepSpeed JSON -> IR: the batch triple resolved as DeepSpeed does, ZeRO, offload, precision."""
import json
from pathlib import Path

import pytest

from ms_llm.convert import ConversionError, ReadOptions, dump, load, read
from ms_llm.job import load_section

FIXTURES = Path(__file__).resolve().parents[2] / "configs" / "examples"    # the peers' configs users convert
LLAMA7 = load_section("model", "llama2_7b")


def _read(cfg: dict, world: int | None = 8):
    return read(json.dumps(cfg), "ds.json", options=ReadOptions(world_size=world, model=LLAMA7))


def test_zero3_offload_config():
    conv = load(FIXTURES / "deepspeed_zero3_offload.json", options=ReadOptions(model=LLAMA7))
    s, t = conv.job.strategy, conv.job.train
    assert conv.world_size == 8                                          # 64 / (2 * 4): dp from the triple
    assert (s.dp, s.zero.stage, s.offload.optimizer, s.offload.params) == (8, 3, True, True)
    assert s.zero.bucket_mb == pytest.approx(5e8 * 2 / 2 ** 20)
    assert (s.precision.param_dtype, s.precision.grad_reduce_dtype) == ("bfloat16", "bfloat16")
    assert (t.global_batch_size, t.micro_batch_size, t.seq_len) == (64, 2, 4096)
    assert (t.steps, t.schedule.warmup_steps, t.schedule.decay, t.schedule.min_lr_ratio) == (20000, 2000, "cosine", 0.1)
    o = t.optimizer
    assert (o.lr, o.beta2, o.weight_decay, o.grad_clip) == (3e-4, 0.95, 0.1, 1.0)
    text = "\n".join(conv.warnings)
    assert "stage3_prefetch_bucket_size" in text and "seq_len" in text


@pytest.mark.parametrize("cfg,world,expected", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 8, (64, 2)),     # gas = 64 / (2*8) = 4
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, (64, 4)),        # mbs = 64 / (2*8)
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 8, (48, 2)),
    ({"train_batch_size": 32}, 8, (32, 4)),                                          # gas = 1
    ({"train_micro_batch_size_per_gpu": 4}, 16, (64, 4)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}, 16, (64, 4)),
])
def test_batch_triple(cfg, world, expected):
    conv = _read(cfg, world)
    assert (conv.job.train.global_batch_size, conv.job.train.micro_batch_size) == expected
    assert conv.world_size == world


@pytest.mark.parametrize("cfg,world,message", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 8,
     r"ds.json: train_batch_size: .* micro \* accumulation \* dp = 2\*2\*8 = 32"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, None, "pass --world-size"),
    ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 2}, 8,
     "ds.json: train_batch_size: 60 is not divisible"),
    ({"gradient_accumulation_steps": 2}, 8, "neither it nor train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 64, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, 8, "fp16.enabled: true together"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": "three"}}, 8, "zero_optimization.stage: got 'three'"),
    ({"train_batch_size": 64, "zero_optimization": {"offload_param": {"device": "disk"}}}, 8,
     "offload_param.device: got 'disk'"),
])
def test_contradictions(cfg, world, message):
    with pytest.raises(ConversionError, match=message):
        _read(cfg, world)


def test_needs_a_model_and_valid_json():
    with pytest.raises(ConversionError, match="holds no model shape; pass --model"):
        read("{}", "ds.json")
    with pytest.raises(ConversionError, match="ds.json: line 1 column 2: not valid JSON"):
        read("{train_batch_size: 1}", "ds.json", options=ReadOptions(model=LLAMA7))


def test_fp16_pipeline_hybrid_and_autotp():
    conv = _read({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True,
                  "initial_scale_power": 12}, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1},
                  "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3, "mics_shard_size": 2}},
                 world=16)
    s = conv.job.strategy
    assert (s.dp, s.tp, s.pp, s.pipeline.micro_batches) == (4, 2, 2, -1)
    assert conv.job.train.global_batch_size // (conv.job.train.micro_batch_size * s.dp) == 16
    assert (s.precision.loss_scale, s.precision.initial_loss_scale) == ("dynamic", 4096.0)
    assert (s.recompute.policy, s.zero.shard_size) == ("full", 2)
    assert any("partition" in w for w in conv.warnings)                 # "parameters" read as uniform


def test_ulysses_and_autoep():
    """sequence_parallel_size is DeepSpeed-Ulysses: cp with the ulysses algorithm; AutoEP's
    autoep_size is ep, for an MoE --model only."""
    moe = load_section("model", "tiny_moe")
    cfg = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
           "expert_parallel": {"enabled": True, "autoep_size": 2, "top_k": "auto"}}
    conv = read(json.dumps(cfg), "ds.json", options=ReadOptions(world_size=8, model=moe))
    s = conv.job.strategy
    assert (s.dp, s.cp, s.ep, s.context_parallel.algorithm) == (4, 2, 2, "ulysses")
    assert not any("sequence_parallel_size" in w or "expert_parallel" in w for w in conv.warnings)
    with pytest.raises(ConversionError, match="ds.json: expert_parallel.enabled: AutoEP needs an MoE model"):
        _read(cfg)


def test_warmup_is_linear_both_ways():
    """DeepSpeed's Warmup*LR schedules warm up logarithmically unless warmup_type says linear, as
    ms_llm does: a config without it reads with a warning, and what ms_llm writes says linear."""
    base = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}
    for params, warned in (({}, True), ({"warmup_type": "linear"}, False), ({"warmup_type": "log"}, True)):
        cfg = base | {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, **params}}}
        conv = _read(cfg)
        assert conv.job.train.schedule.warmup_steps == 10
        assert any("warmup_type = log" in w for w in conv.warnings) == warned, conv.warnings
    written = json.loads(dump(conv, "deepspeed").text)["scheduler"]["params"]
    assert (written["warmup_type"], written["warmup_num_steps"]) == ("linear", 10)
