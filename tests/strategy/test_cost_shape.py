"""The search prices strategies from cost.shape_of (degrees only); ModelPlan-based pricing must agree
exactly. Also the cost-model fixes: ZeRO-2/3 traffic per micro-batch, interleaved in-flight cap."""
import dataclasses

import pytest

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.job import load_section
from ms_llm.strategy.cost import communication, cost_shape, estimate, memory, shape_of
from ms_llm.strategy.devices import get_device
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan
from ms_llm.strategy.validate import validate

MOE = ModelConfig(name="moe", vocab_size=512, hidden_size=128, num_layers=8, num_heads=8, num_kv_heads=2,
                  ffn_hidden_size=256, moe=MoEConfig(num_experts=8, top_k=2))

CASES = [
    ("llama2_7b", {"dp": 8, "zero": {"stage": 1}}, {"global_batch_size": 64, "seq_len": 4096}, None),
    ("llama2_70b", {"dp": 2, "tp": 4, "pp": 8, "sequence_parallel": True, "pipeline": {"micro_batches": 128}},
     {"global_batch_size": 256, "seq_len": 4096}, None),
    ("llama2_70b", {"tp": 8, "pp": 4, "cp": 2, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 5},
                    "recompute": {"policy": "full", "num_layers": 3}, "zero": {"stage": 2}},
     {"global_batch_size": 512, "seq_len": 4096}, 128),
    ("llama3_8b", {"pp": 4, "pipeline": {"schedule": "zbv", "virtual_stages": 2}, "zero": {"stage": 3, "shard_size": 2},
                   "recompute": {"policy": "selective"}}, {"global_batch_size": 64, "seq_len": 2048}, 16),
    ("llama3_8b", {"pp": 4, "pipeline": {"layer_split": [7, 9, 9, 7]}, "recompute": {"policy": "full"}},
     {"global_batch_size": 32, "seq_len": 2048}, 8),
    ("tiny", {"tp": 2, "sequence_parallel": True}, {"global_batch_size": 8, "seq_len": 128}, 4),
    ("tiny", {"dp": 2}, {"global_batch_size": 8, "seq_len": 128}, None),
    ("qwen3_32b", {"dp": 2, "tp": 8, "pp": 4, "zero": {"stage": 1}}, {"global_batch_size": 64, "seq_len": 4096}, 64),
    ("qwen2_7b", {"tp": 4, "pp": 7, "sequence_parallel": True}, {"global_batch_size": 28, "seq_len": 4096}, 28),
]


def _model(name):
    return MOE if name == "moe" else load_section("model", name)


@pytest.mark.parametrize("name,strategy,train,world", CASES + [
    ("moe", {"ep": 4, "tp": 2, "zero": {"stage": 1}}, {"global_batch_size": 16, "seq_len": 128}, 8),
    ("deepseek_moe_16b", {"ep": 8, "pp": 4, "zero": {"stage": 3}}, {"global_batch_size": 64, "seq_len": 4096}, 32),
    ("mixtral_8x7b", {"ep": 4, "tp": 2, "pp": 2, "zero": {"stage": 1}}, {"global_batch_size": 64, "seq_len": 4096},
     16),
    ("mixtral_8x7b", {"ep": 8, "etp": 1, "tp": 4, "pp": 2, "zero": {"stage": 1}},            # ep folded over tp
     {"global_batch_size": 64, "seq_len": 4096}, 16),
    ("moe", {"ep": 2, "etp": 2, "zero": {"stage": 3}}, {"global_batch_size": 16, "seq_len": 128}, 8)])
def test_shape_of_equals_the_plan(name, strategy, train, world):
    model = _model(name)
    s = from_dict(ParallelStrategy, strategy, "strategy")
    t = from_dict(TrainConfig, train, "train")
    p = plan(model, s, t, world)
    shape = shape_of(model, validate(model, s, t, world), t)
    assert cost_shape(p) == shape
    for device in ("h100", "910b"):
        assert estimate(p, get_device(device)) == estimate(shape, get_device(device))


def test_zero3_and_zero2_pay_their_collectives_per_micro_batch():
    model = load_section("model", "llama3_8b")
    volumes = {}
    for stage in (1, 2, 3):
        for mb in (1, 4):
            s = from_dict(ParallelStrategy, {"dp": 8, "zero": {"stage": stage}, "pipeline": {"micro_batches": mb}})
            t = TrainConfig(global_batch_size=8 * mb, seq_len=2048)
            volumes[stage, mb] = communication(plan(model, s, t)).bytes_by_axis["dp_cp"]
    assert volumes[1, 4] == volumes[1, 1]                       # accumulate locally, reduce once
    assert volumes[3, 4] == pytest.approx(4 * volumes[3, 1])    # gather params every micro-batch
    assert volumes[3, 1] < volumes[3, 4]
    ratio = (volumes[2, 4] - volumes[2, 1]) / volumes[2, 1]
    assert 0 < ratio < 3                                        # only the gradient part repeats


def test_interleaved_in_flight_never_exceeds_the_micro_batches():
    model = load_section("model", "llama2_13b")
    s = from_dict(ParallelStrategy, {"dp": 1, "pp": 8, "pipeline": {"schedule": "interleaved_1f1b",
                                                                     "virtual_stages": 5, "micro_batches": 8}})
    t = TrainConfig(global_batch_size=8, seq_len=1024)
    assert memory(plan(model, s, t)).in_flight_micro_batches == 8
    more = dataclasses.replace(s, pipeline=dataclasses.replace(s.pipeline, micro_batches=64))
    in_flight = memory(plan(model, more, TrainConfig(global_batch_size=64, seq_len=1024))).in_flight_micro_batches
    assert in_flight == pytest.approx(8 * (1 + 7 / 40))


def test_expert_parallel_trades_expert_memory_for_all_to_all():
    """Mixtral on 16 H100s (dp 16): ep 8 keeps 1/8 of the experts per rank (replicated over edp,
    ZeRO-1 shards only their optimizer states over it), and pays 4 x tokens x top_k x hidden x
    (ep-1)/ep per MoE layer."""
    model = load_section("model", "mixtral_8x7b")
    t = TrainConfig(global_batch_size=32, micro_batch_size=1, seq_len=4096)
    shapes = {ep: shape_of(model, validate(model, from_dict(ParallelStrategy, {"dp": 16, "ep": ep,
                                                                           "zero": {"stage": 1}}), t, 16), t)
              for ep in (1, 8)}
    experts = {ep: shapes[ep].stages[0].expert_params for ep in shapes}
    assert experts[1] == 32 * 3 * 8 * 4096 * 14336 and experts[8] == experts[1] // 8
    assert memory(shapes[8]).params < memory(shapes[1]).params
    assert "ep" not in communication(shapes[1]).bytes_by_axis
    tokens = 4096                                     # one micro-batch of one sequence per rank
    want = 4 * tokens * 2 * 4096 * 2 * 7 / 8 * 32 * 2    # bf16, 32 MoE layers, 2 micro-batches
    assert communication(shapes[8]).bytes_by_axis["ep"] == pytest.approx(want)
