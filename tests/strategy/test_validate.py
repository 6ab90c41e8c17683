"""Catalogue of invalid strategies: each is refused with a message naming the field and a fix."""
import dataclasses

import pytest

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import StrategyError
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.validate import validate

MODEL = dict(vocab_size=512, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
             ffn_hidden_size=768, max_seq_len=1024, dtype="float32")
TRAIN = dict(global_batch_size=16, micro_batch_size=1, seq_len=256)

# (id, strategy, model overrides, train overrides, world size, expected message fragment)
CATALOGUE = [
    ("world-mismatch", {"dp": 2, "tp": 2}, {}, {}, 8, r"dp\*tp\*pp\*cp = 2\*2\*1\*1 = 4 but the world size is 8"),
    ("leftover-indivisible", {"tp": 4}, {}, {}, 6, r"strategy\.dp: -1 cannot be resolved: world size 6 is not divisible by tp\*pp\*cp"),
    ("heads-tp", {"tp": 16, "dp": 1}, {"num_heads": 8, "num_kv_heads": 8}, {}, 16, r"model\.num_heads = 8 is not divisible by 16"),
    ("kv-heads-tp", {"tp": 8, "dp": 1}, {}, {}, 8, r"model\.num_kv_heads = 4 is not divisible by 8"),
    ("ffn-tp", {"tp": 4, "dp": 1}, {"ffn_hidden_size": 770}, {}, 4, r"model\.ffn_hidden_size = 770 is not divisible by 4"),
    ("vocab-tp", {"tp": 4, "dp": 1}, {"vocab_size": 510}, {}, 4, r"pad model\.vocab_size to a multiple of 4"),
    ("sp-without-tp", {"sequence_parallel": True, "dp": 1}, {}, {}, 1, r"sequence_parallel: needs tp > 1"),
    ("cp-seq", {"cp": 4, "dp": 1, "context_parallel": {"algorithm": "ring"}}, {}, {"seq_len": 100}, 4,
     r"train\.seq_len = 100 is not divisible by 8; ring context parallel"),
    ("ulysses-heads", {"cp": 4, "tp": 4, "dp": 1, "context_parallel": {"algorithm": "ulysses"}},
     {"num_kv_heads": 8}, {}, 16, r"strategy\.context_parallel\.algorithm: model\.num_heads = 8 is not divisible by 16"),
    ("cp-auto-none", {"cp": 3, "dp": 1}, {}, {"seq_len": 99}, 3, r"strategy\.cp: no context-parallel algorithm fits"),
    ("sp-seq", {"tp": 2, "sequence_parallel": True, "dp": 1}, {}, {"seq_len": 99}, 2, r"sequence_parallel: train\.seq_len = 99 is not divisible by 2"),
    ("seq-too-long", {"dp": 1}, {"max_seq_len": 128}, {}, 1, r"train\.seq_len: 256 exceeds model\.max_seq_len=128"),
    ("pp-gt-layers", {"pp": 16, "dp": 1}, {}, {}, 16, r"strategy\.pp: 16 stages for 8 layers"),
    ("layers-pp", {"pp": 3, "dp": 1, "pipeline": {"schedule": "gpipe"}}, {}, {"global_batch_size": 16}, 3, r"model\.num_layers = 8 is not divisible by 3"),
    ("layers-vpp", {"pp": 2, "dp": 1, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 3}}, {}, {}, 2, r"pp\*virtual_stages = 2\*3"),
    ("split-length", {"pp": 2, "dp": 1, "pipeline": {"layer_split": [8]}}, {}, {}, 2, r"layer_split: 1 entries, need pp\*virtual_stages = 2"),
    ("split-sum", {"pp": 2, "dp": 1, "pipeline": {"layer_split": [3, 4]}}, {}, {}, 2, r"layer_split: sums to 7, model\.num_layers is 8"),
    ("split-empty-chunk", {"pp": 2, "dp": 1, "pipeline": {"layer_split": [8, 0]}}, {}, {}, 2, r"every chunk needs at least 1 layer"),
    ("interleaved-needs-vpp", {"pp": 2, "dp": 1, "pipeline": {"schedule": "interleaved_1f1b"}}, {}, {}, 2, r"interleaved_1f1b needs >= 2 chunks per rank"),
    ("vpp-needs-interleaved", {"pp": 2, "dp": 1, "pipeline": {"virtual_stages": 2}}, {}, {}, 2, r"schedule: 1f1b runs one chunk per rank but virtual_stages = 2"),
    ("vpp-needs-pp", {"dp": 1, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, {}, {}, 1, r"virtual stages need pp > 1"),
    ("zbv-two-chunks", {"pp": 2, "dp": 1, "pipeline": {"schedule": "zbv", "virtual_stages": 4}}, {"num_layers": 8}, {}, 2, r"zbv is a V schedule of exactly 2 chunks"),
    ("interleaved-mb", {"pp": 4, "dp": 1, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2, "micro_batches": 6}}, {}, {"global_batch_size": 6}, 4, r"interleaved_1f1b needs micro_batches % pp == 0, got 6 % 4"),
    ("1f1b-too-few-mb", {"pp": 4, "dp": 1, "pipeline": {"micro_batches": 2}}, {}, {"global_batch_size": 2}, 4, r"1f1b needs at least pp = 4 micro-batches"),
    ("tied-with-pp", {"pp": 2, "dp": 1}, {"tie_embeddings": True}, {}, 2, r"model\.tie_embeddings: tied embeddings with pp > 1"),
    ("global-batch", {"dp": 4, "pipeline": {"micro_batches": 3}}, {}, {"global_batch_size": 16}, 4, r"train\.global_batch_size: 16 != micro_batch_size \* dp \* micro_batches = 1\*4\*3 = 12"),
    ("zero-shard-divides", {"dp": 6, "zero": {"stage": 3, "shard_size": 4}}, {}, {"global_batch_size": 12}, 6, r"zero\.shard_size: 4 does not divide dp = 6"),
    ("zero-shard-too-big", {"dp": 2, "zero": {"stage": 3, "shard_size": 4}}, {}, {}, 2, r"zero\.shard_size: 4 exceeds dp = 2"),
    ("ep-dense", {"ep": 2, "dp": 2}, {}, {}, 2, r"strategy\.ep: 2 but the model is dense"),
    ("ep-experts", {"ep": 4, "dp": 4}, {"moe": {"num_experts": 6}}, {}, 4, r"model\.moe\.num_experts = 6 is not divisible by 4"),
    ("ep-fold", {"ep": 4, "dp": 2}, {"moe": {"num_experts": 8}}, {}, 2,
     r"strategy\.ep: ep\*etp = 4\*1 = 4 must divide dp\*cp\*tp = 2\*1\*1 = 2"),
    ("etp-defaults-to-tp", {"ep": 4, "dp": 2, "tp": 2}, {"moe": {"num_experts": 8}}, {}, 4,
     r"strategy\.ep: ep\*etp = 4\*2 = 8 must divide dp\*cp\*tp = 2\*1\*2 = 4 .* etp \(-1 = tp, 1 = whole experts\)"),
    ("etp-width", {"dp": 2, "etp": 2}, {"moe": {"num_experts": 8, "expert_ffn_hidden_size": 33}}, {}, 2,
     r"strategy\.etp: the expert width \(model\.moe\.expert_ffn_hidden_size\) = 33 is not divisible by 2"),
    ("etp-dense", {"dp": 2, "etp": 2}, {}, {}, 2, r"strategy\.etp: 2 but the model is dense"),
    ("etp-zero", {"dp": 2, "etp": 0}, {}, {}, 2, r"strategy\.etp: 0 ranks cannot hold an expert"),
    ("recompute-layers-without-policy", {"dp": 1, "recompute": {"num_layers": 2}}, {}, {}, 1, r"recompute\.num_layers: set but policy is 'none'"),
    ("recompute-too-many-layers", {"pp": 2, "dp": 1, "recompute": {"policy": "full", "num_layers": 6}}, {}, {}, 2, r"recompute\.num_layers: 6 exceeds the 4 layers of a stage"),
    ("fp16-needs-scaling", {"dp": 1, "precision": {"param_dtype": "float16", "compute_dtype": "float16"}}, {}, {}, 1, r"precision\.loss_scale: fp16 needs loss scaling"),
    ("master-narrower", {"dp": 1, "precision": {"param_dtype": "float32", "master_dtype": "bfloat16"}}, {}, {}, 1, r"master_dtype: bfloat16 is narrower than param_dtype float32"),
    ("fp32-with-scaling", {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32", "loss_scale": "dynamic"}}, {}, {}, 1, r"fp32 training needs no loss scaling"),
    ("offload-params-stage", {"dp": 2, "zero": {"stage": 2}, "offload": {"params": True}}, {}, {}, 2, r"offload\.params: needs zero\.stage 3"),
    ("offload-optimizer-stage", {"dp": 2, "offload": {"optimizer": True}}, {}, {}, 2, r"offload\.optimizer: needs zero\.stage >= 1"),
    ("dp-unresolved", {"tp": 2}, {}, {}, None, r"strategy\.dp: -1 needs a world size"),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_invalid_strategy_is_refused_with_a_fix(case):
    _, strategy, model, train, world, message = case
    m = from_dict(ModelConfig, {**MODEL, **model}, "model")
    t = TrainConfig(**{**TRAIN, **train})
    with pytest.raises(StrategyError, match=message) as info:
        validate(m, from_dict(ParallelStrategy, strategy, "strategy"), t, world)
    assert str(info.value).count("strategy") + str(info.value).count("model.") + str(info.value).count("train.") >= 1


def test_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 30
    assert len({c[-1] for c in CATALOGUE}) == len(CATALOGUE)


def test_all_problems_are_reported_together():
    m = ModelConfig(**{**MODEL, "num_heads": 6, "num_kv_heads": 6, "hidden_size": 258})
    s = ParallelStrategy(dp=1, tp=4, sequence_parallel=False, offload=from_dict(type(ParallelStrategy().offload), {"optimizer": True}))
    with pytest.raises(StrategyError) as info:
        validate(m, s, TrainConfig(**TRAIN), 4)
    assert len(info.value.problems) >= 3 and "problems:" in str(info.value)


def test_every_broken_expert_rule_is_listed():
    """ep not dividing the experts, etp not dividing their width and ep*etp not dividing the stage's
    ranks: three problems, each naming its field."""
    m = from_dict(ModelConfig, {**MODEL, "moe": {"num_experts": 6, "expert_ffn_hidden_size": 30}}, "model")
    with pytest.raises(StrategyError) as info:
        validate(m, ParallelStrategy(dp=4, ep=4, etp=4), TrainConfig(**TRAIN), 4)
    assert [p.split(":")[0] for p in info.value.problems] == ["strategy.ep", "strategy.etp", "strategy.ep"]


@pytest.mark.parametrize("strategy, world, edp", [
    ({"dp": 4, "ep": 2}, 4, 2),                          # ep over dp, etp = tp = 1
    ({"dp": 2, "tp": 2, "ep": 2}, 4, 1),                 # etp = tp = 2: as before etp existed
    ({"dp": 2, "tp": 2, "ep": 4, "etp": 1}, 4, 1),       # ep folded over dp x tp, whole experts
    ({"dp": 4, "ep": 2, "etp": 2}, 4, 1),                # etp carved out of dp
    ({"dp": 4, "tp": 8, "ep": 32, "etp": 1}, 32, 1),     # MindFormers' DeepSeek-V3: ep 32 over dp4 x mp8
    ({"dp": 2, "cp": 2, "tp": 2, "ep": 2, "etp": 1}, 8, 4),
])
def test_expert_folding_is_valid(strategy, world, edp):
    m = from_dict(ModelConfig, {**MODEL, "num_kv_heads": 8, "moe": {"num_experts": 32, "expert_ffn_hidden_size": 64}},
                  "model")
    s = validate(m, from_dict(ParallelStrategy, strategy, "strategy"), TrainConfig(**{**TRAIN, "global_batch_size": 32}),
                 world)
    assert s.etp == strategy.get("etp", s.tp) and s.edp == edp and s.edp * s.ep * s.etp == s.dp * s.cp * s.tp


def test_valid_strategies_resolve_derived_values():
    m = ModelConfig(**MODEL)
    s = validate(m, ParallelStrategy(tp=2, zero=from_dict(type(ParallelStrategy().zero), {"stage": 2})),
                 TrainConfig(**TRAIN), 8)
    assert (s.dp, s.zero.shard_size, s.pipeline.micro_batches) == (4, 4, 4)
    s = validate(m, ParallelStrategy(dp=2, pp=2, pipeline=dataclasses.replace(ParallelStrategy().pipeline,
                 schedule="interleaved_1f1b", virtual_stages=2)), TrainConfig(**TRAIN), 4)
    assert s.pipeline.micro_batches == 8
