"""ZeRO partition plan, without processes: ownership, padding, buckets, groups, schedule."""
import numpy as np
import pytest

from ms_llm.config.model import ModelConfig, MoEConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import OptimizerConfig, TrainConfig
from ms_llm.strategy import cost
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan
from ms_llm.zero import zero_plan, zero_plan_for_params
from ms_llm.zero.partition import align_elements

MODEL = ModelConfig(vocab_size=320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=192, max_seq_len=64, dtype="float32")
TRAIN = TrainConfig(global_batch_size=16, micro_batch_size=1, seq_len=32)

STRATEGIES = [
    ({"dp": 2, "zero": {"stage": 1}}, 2),
    ({"dp": 4, "zero": {"stage": 2, "bucket_mb": 0.05}}, 4),
    ({"dp": 4, "zero": {"stage": 3, "shard_size": 2}}, 4),
    ({"dp": 2, "tp": 2, "zero": {"stage": 3, "bucket_mb": 0.01}}, 4),
    ({"dp": 2, "pp": 2, "tp": 2, "zero": {"stage": 2}}, 8),
    ({"dp": 2, "cp": 2, "zero": {"stage": 1}}, 4),
    ({"dp": 4, "zero": {"stage": 0}}, 4),
]


def make(strategy, world, model=MODEL, precision="float32"):
    strategy = {**strategy, "precision": {"param_dtype": precision}}
    return plan(model, from_dict(ParallelStrategy, strategy, "strategy"), TRAIN, world)


@pytest.mark.parametrize("strategy,world", STRATEGIES)
def test_every_element_owned_exactly_once_per_shard_group(strategy, world):
    mp = make(strategy, world)
    z = zero_plan(mp)
    for rank in range(world):
        group = z.group_of("shard", rank)
        stage = z.pipeline_stage(rank)
        counts = {e.name: np.zeros(e.local_shape, dtype=np.int64) for e in z.entries if e.stage == stage}
        for r in group:
            for piece in z.owned(r):
                (off, size) = piece.local_box
                index = tuple(slice(o, o + s) for o, s in zip(off, size))
                counts[piece.name][index] += 1
                assert piece.numel == int(np.prod(size))
        # Sharded pieces are disjoint (count 1); a replicated bucket is held whole by each.
        for name, c in counts.items():
            bucket, _ = z.slot(name)
            expected = 1 if bucket.sharded else len(group)
            assert (c == expected).all(), (name, np.unique(c))


@pytest.mark.parametrize("strategy,world", STRATEGIES)
def test_sharded_pieces_are_the_plans_zero_layout(strategy, world):
    mp = make(strategy, world)
    z = zero_plan(mp)
    for rank in range(world):
        for piece in z.owned(rank):
            bucket, _ = z.slot(piece.name)
            p = mp.params[piece.name]
            expected = (p.zero_layout if bucket.sharded else p.layout).shard_box(mp.stage_rank(rank))
            assert piece.global_box == expected, piece


@pytest.mark.parametrize("strategy,world", STRATEGIES)
def test_one_primary_copy_of_every_element(strategy, world):
    mp = make(strategy, world)
    z = zero_plan(mp)
    counts = {name: np.zeros(p.shape, dtype=np.int64) for name, p in mp.params.items()}
    for rank in range(world):
        for piece in z.owned(rank):
            if piece.primary:
                off, size = piece.global_box
                counts[piece.name][tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
    for name, c in counts.items():
        assert (c == 1).all(), name


def test_buffers_are_padded_and_contiguous():
    z = zero_plan(make({"dp": 4, "zero": {"stage": 2, "bucket_mb": 0.01}}, 4, precision="bfloat16"))
    align = align_elements("bfloat16")
    assert align == 32
    for buf in z.buffers:
        start = 0
        for i in buf.buckets:
            b = z.buckets[i]
            assert b.start == start and b.segment % align == 0
            assert b.segment - b.padding == sum(s.numel for s in b.slots)
            offsets = [s.offset for s in b.slots]
            assert offsets == sorted(offsets) and offsets[0] == 0
            start += b.numel
        assert start == buf.numel
    odd = ModelConfig(vocab_size=330, hidden_size=60, num_layers=1, num_heads=4, ffn_hidden_size=100, dtype="float32")
    zo = zero_plan(make({"dp": 4, "zero": {"stage": 1}}, 4, model=odd))
    assert any(b.padding for b in zo.buckets)


def test_bucket_size_and_units():
    mp = make({"dp": 2, "zero": {"stage": 2, "bucket_mb": 0.1}}, 2)
    z = zero_plan(mp)
    cap = int(0.1 * 2 ** 20) // 4
    for b in z.buckets:
        total = sum(s.numel * s.parts for s in b.slots)
        assert total <= cap or len(b.slots) == 1
    assert any(len(b.units) > 1 for b in z.buckets)          # stage 2 buckets span layers
    z3 = zero_plan(make({"dp": 2, "zero": {"stage": 3, "bucket_mb": 0.1}}, 2))
    assert all(len(b.units) == 1 for b in z3.buckets)         # stage 3 never does
    assert [u.name for u in z3.units] == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "final"]
    assert z3.units[1].modules == ("model.layers.0",)
    assert z3.units[-1].modules == ("model.norm", "lm_head")
    one = zero_plan(make({"dp": 2, "zero": {"stage": 2, "bucket_mb": 0}}, 2))
    assert all(len(b.slots) == 1 for b in one.buckets) and len(one.buckets) == len(mp.params)


def test_deterministic():
    a = zero_plan(make({"dp": 2, "tp": 2, "zero": {"stage": 3}}, 4))
    b = zero_plan(make({"dp": 2, "tp": 2, "zero": {"stage": 3}}, 4))
    assert a == b
    assert a.owned(3) == b.owned(3)


def test_hsdp_groups():
    z = zero_plan(make({"dp": 4, "zero": {"stage": 3, "shard_size": 2}}, 4))
    assert z.groups["shard"] == [[0, 1], [2, 3]]
    assert z.groups["replicate"] == [[0, 2], [1, 3]]
    assert z.groups["dp"] == [[0, 1, 2, 3]]
    assert all(b.parts == 2 for b in z.buckets)
    assert z.shard_index(2) == 0 and z.shard_index(3) == 1
    ops = [c.op for c in z.grad_collectives(z.buckets[0])]
    assert ops == ["reduce_scatter", "all_reduce"]
    tp = zero_plan(make({"dp": 2, "tp": 2, "zero": {"stage": 1}}, 4))
    assert tp.groups["shard"] == [[0, 2], [1, 3]]


def test_collective_schedule_per_stage():
    def phases(stage):
        z = zero_plan(make({"dp": 2, "zero": {"stage": stage}}, 2))
        b = z.buckets[0]
        return ([(c.op, c.group, c.phase) for c in z.grad_collectives(b)],
                [(c.op, c.phase) for c in z.param_collectives(b)])
    assert phases(0) == ([("all_reduce", "dp", "backward_sync")], [])
    assert phases(1) == ([("reduce_scatter", "shard", "backward_sync")], [("all_gather", "after_step")])
    assert phases(2) == ([("reduce_scatter", "shard", "backward")], [("all_gather", "after_step")])
    assert phases(3) == ([("reduce_scatter", "shard", "backward")],
                         [("all_gather", "before_forward"), ("all_gather", "before_backward")])


def test_unsplittable_parameter_gets_a_replicated_bucket():
    strategy = from_dict(ParallelStrategy, {"dp": 4, "zero": {"stage": 2}}, "strategy")
    z = zero_plan_for_params([("a", (6, 4), "l0", "a"), ("b", (3,), "l0", "b"), ("c", (8,), "l1", "c")],
                             strategy, 4, "float32")
    kinds = {s.name: (b.sharded, s.zero_dim) for b in z.buckets for s in b.slots}
    assert kinds == {"a": (True, 1), "b": (False, None), "c": (True, 0)}   # 6 x 4 splits on dim 1
    piece = next(p for p in z.owned(2) if p.name == "a")
    assert piece.local_box == ((0, 2), (6, 1)) and not piece.contiguous
    assert z.slot("c")[1].numel == 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype,optimizer", [("float32", "adamw"), ("bfloat16", "adamw"), ("float32", "sgd")])
def test_planned_bytes_match_the_cost_formula(stage, dtype, optimizer):
    train = TrainConfig(global_batch_size=16, micro_batch_size=1, seq_len=32, optimizer=OptimizerConfig(name=optimizer))
    strategy = from_dict(ParallelStrategy, {"dp": 4, "zero": {"stage": stage}, "precision": {"param_dtype": dtype}},
                         "strategy")
    mp = plan(MODEL, strategy, train, 4)
    z = zero_plan(mp)
    mem = cost.memory(mp)
    master = "float32" if dtype != "float32" else None
    got = z.model_state_bytes(1, optimizer, master)
    for key, want in (("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer)):
        assert got[key] == pytest.approx(want, rel=0.02, abs=0), key


def test_moe_partitions_the_experts_over_their_expert_data_parallel_group():
    """The routed experts join the partition in buckets of their own, split over edp, the ranks holding
    the same expert shard (dp4 x ep2: [0, 2] and [1, 3]), the dense parameters over all of dp."""
    moe = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, ffn_hidden_size=64,
                      moe=MoEConfig(num_experts=4), dtype="float32")
    p = make({"dp": 4, "ep": 2, "zero": {"stage": 3}}, 4, model=moe)
    z = zero_plan(p)
    experts = {n for n, q in p.params.items() if q.kind.startswith("expert")}
    assert len(experts) == 3 and {s.name for b in z.buckets for s in b.slots} == set(p.params)
    for b in z.buckets:
        assert {s.name in experts for s in b.slots} == {b.expert}
        assert b.parts == (2 if b.expert else 4)
    assert z.groups["expert_shard"] == z.groups["expert_dp"] == [[0, 2], [1, 3]]
    bucket = next(b for b in z.buckets if b.expert)
    assert [z.segment_index(r, bucket) for r in range(4)] == [0, 0, 1, 1]