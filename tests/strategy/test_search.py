"""Strategy search: what it returns is valid and priced like a full plan, its pruning loses nothing,
and published configurations (read from their own formats) validate and rank near the top."""
import dataclasses
import hashlib
from pathlib import Path

import pytest

from ms_llm.config.train import TrainConfig
from ms_llm.convert import ReadOptions, load
from ms_llm.errors import ConfigError
from ms_llm.job import load_section
from ms_llm.strategy.cost import estimate
from ms_llm.strategy.devices import get_device
from ms_llm.strategy.ir import RecomputeSpec
from ms_llm.strategy.plan import plan
from ms_llm.strategy.search import SearchSpace, price, search

FIXTURES = Path(__file__).resolve().parents[2] / "configs" / "examples"    # the peers' configs users convert


def test_every_ranked_strategy_plans_and_fits():
    model = load_section("model", "llama2_13b")
    train = TrainConfig(global_batch_size=64, seq_len=4096)
    device = get_device("a100")
    result = search(model, train, 32, device)
    assert result.ranked and result.enumerated == result.invalid + result.too_big + len(result.ranked)
    steps = [c.estimate.step_s for c in result.ranked]
    assert steps == sorted(steps)
    for c in result.ranked[:5] + result.ranked[-3:]:
        p = plan(model, c.strategy, c.train, 32)          # the full plan accepts it ...
        assert estimate(p, device) == c.estimate           # ... and prices it the same
        assert c.estimate.fits and p.world_size == 32
        assert c.train.global_batch_size == 64


def test_more_recompute_is_never_faster():
    """The search keeps only the first recompute policy that fits; that is exact if each step of
    none -> selective -> full only adds time."""
    model = load_section("model", "llama2_70b")
    train = TrainConfig(global_batch_size=256, seq_len=4096)
    device = get_device("h100")
    result = search(model, train, 64, device, space=SearchSpace(recompute=("none",)))
    roomy = dataclasses.replace(device, memory_bytes=1e15)
    for c in result.ranked[::40]:
        times = [price(model, dataclasses.replace(c.strategy, recompute=RecomputeSpec(policy=p)), c.train,
                       roomy).estimate.step_s for p in ("none", "selective", "full")]
        assert times[0] <= times[1] <= times[2]


def test_pruned_search_matches_trying_every_policy():
    model = load_section("model", "llama2_7b")
    train = TrainConfig(global_batch_size=32, seq_len=4096)
    device = get_device("910b")
    best = search(model, train, 16, device).ranked[0]
    exhaustive = []
    for policy in ("none", "selective", "full"):
        exhaustive += search(model, train, 16, device, space=SearchSpace(recompute=(policy,))).ranked
    assert best.estimate.step_s == min(c.estimate.step_s for c in exhaustive)


# The bench's search (bench/search_strategy.py), its ten fastest as the cost model ranked them before the
# search's prunings: (dp, zero, tp, sp, pp, vpp, micro-batches, cp, cp algorithm, micro-batch size,
# recompute), step seconds. The eighth and ninth tie exactly (step, bytes moved and memory) and keep
# enumeration order. RANKING_70B_1024_H100: sha256 of all 4102 ranked, one repr((degrees, step seconds,
# memory bytes)) a line. A deliberate change to the cost model updates both.
TOP_70B_1024_H100 = [
    ((32, 1, 2, True, 4, 5, 32, 4, "ring", 1, "none"), 3.107355520068989),
    ((32, 1, 2, True, 4, 4, 32, 4, "ring", 1, "none"), 3.1102295652239897),
    ((16, 1, 1, False, 8, 5, 64, 8, "ring", 1, "none"), 3.1252351898259794),
    ((32, 1, 2, False, 4, 4, 32, 4, "ring", 1, "none"), 3.1531792381839896),
    ((32, 1, 2, True, 4, 2, 32, 4, "ring", 1, "none"), 3.156812045718992),
    ((16, 1, 1, False, 8, 2, 64, 8, "ring", 1, "none"), 3.157474981584062),
    ((32, 1, 2, False, 4, 5, 32, 4, "ring", 1, "none"), 3.161042611268989),
    ((64, 1, 2, True, 4, 5, 16, 2, "ring", 1, "none"), 3.161801373648991),
    ((32, 1, 2, True, 4, 5, 16, 4, "ring", 2, "none"), 3.161801373648991),
    ((64, 1, 2, True, 4, 4, 16, 2, "ring", 1, "none"), 3.178286882198992),
]
RANKING_70B_1024_H100 = "214f485c1a020accb45d3dcd898504b39fe9816e9c1cfb92362eed76f20fe141"


def test_70b_on_1024_devices():
    """The bench's search: every count and the ten fastest strategies, bit for bit, as they were
    before the search stopped pricing what cannot fit or win (memory first, one estimate per cp
    algorithm pick, stages no bigger than the one before skipped)."""
    model = load_section("model", "llama2_70b")
    result = search(model, TrainConfig(global_batch_size=1024, seq_len=4096), 1024, get_device("h100"))
    assert (result.enumerated, result.priced, result.invalid, result.too_big, len(result.ranked)) == \
        (5888, 8045, 1148, 638, 4102)
    ranked = [((s.dp, s.zero.stage, s.tp, s.sequence_parallel, s.pp, s.pipeline.virtual_stages,
                s.pipeline.micro_batches, s.cp, s.context_parallel.algorithm, c.train.micro_batch_size,
                s.recompute.policy), c.estimate.step_s, c.estimate.memory.total)
              for c in result.ranked for s in [c.strategy]]
    assert [(degrees, step) for degrees, step, _ in ranked[:10]] == TOP_70B_1024_H100
    assert hashlib.sha256("\n".join(map(repr, ranked)).encode()).hexdigest() == RANKING_70B_1024_H100
    best = result.ranked[0]
    assert estimate(plan(model, best.strategy, best.train, 1024), get_device("h100")) == best.estimate


def _rank_published(path, **options):
    conv = load(FIXTURES / path, None, ReadOptions(**options))
    job = conv.job
    device = get_device(job.device)
    published = price(job.model, job.strategy, job.train, device, conv.world_size)
    result = search(job.model, job.train, conv.world_size, device, base=job.strategy)
    return published, result


def test_mindformers_llama2_70b_on_64_910b_ranks_near_the_top():
    published, result = _rank_published("mindformers_r1_llama2_70b.yaml")
    s = published.strategy
    assert (s.dp, s.tp, s.pp, s.sequence_parallel, s.zero.stage, s.pipeline.micro_batches) == (2, 4, 8, True, 1, 128)
    assert published.estimate.fits
    rank = result.rank_of(published)
    assert rank <= 0.15 * len(result.ranked)
    assert published.estimate.step_s <= 1.15 * result.ranked[0].estimate.step_s


def test_megatron_gpt3_175b_on_1024_h100_ranks_near_the_top():
    published, result = _rank_published("megatron_gpt3_175b.sh")
    s = published.strategy
    assert (s.dp, s.tp, s.pp, s.pipeline.micro_batches) == (8, 8, 16, 192)
    assert published.estimate.fits
    rank = result.rank_of(published)
    assert rank <= 0.15 * len(result.ranked)
    assert published.estimate.step_s <= 1.3 * result.ranked[0].estimate.step_s


def test_no_strategy_fits_and_bad_world_size():
    model = load_section("model", "llama2_70b")
    result = search(model, TrainConfig(global_batch_size=8, seq_len=4096), 8, get_device("cpu"))
    assert result.ranked == () and result.too_big > 0
    with pytest.raises(ConfigError, match="--world-size"):
        search(model, TrainConfig(), 0, get_device("h100"))


def test_moe_search_varies_expert_parallel():
    """Mixtral on 64 H100s: ep is a searched degree (dividing dp*cp and the 8 experts), every
    candidate plans, and at least one ranked strategy splits the experts."""
    model = load_section("model", "mixtral_8x7b")
    train = TrainConfig(global_batch_size=256, seq_len=4096)
    space = SearchSpace(micro_batch_sizes=(1,), zero_stages=(1,), schedules=("1f1b",), recompute=("full",))
    result = search(model, train, 64, get_device("h100"), space=space)
    eps = {c.strategy.ep for c in result.ranked}
    assert eps <= {1, 2, 4, 8} and max(eps) > 1
    best = result.ranked[0]
    plan(model, best.strategy, best.train, 64)
    # expert tensor parallel is searched too: tp (the width split like the dense MLP) or 1 (whole experts,
    # ep folded over tp as well), each candidate's experts folding over its stage's ranks
    folds = {(c.strategy.tp, c.strategy.etp) for c in result.ranked}
    assert {(8, 8), (8, 1), (1, 1)} <= folds and all(etp in (1, tp) for tp, etp in folds)
    assert any(c.strategy.ep > c.strategy.dp * c.strategy.cp for c in result.ranked)
