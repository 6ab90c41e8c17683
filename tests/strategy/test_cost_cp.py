"""Context parallel in the cost model: what each algorithm moves and keeps, and which one
'auto' and `ms-llm search` pick."""
import dataclasses

import pytest

from ms_llm.config.schema import from_dict
from ms_llm.job import CONFIG_ROOT, load_job
from ms_llm.strategy.cost import communication, cp_algorithm, cp_algorithms, estimate, memory, shape_of
from ms_llm.strategy.devices import DEVICES
from ms_llm.strategy.ir import ContextParallelSpec, ParallelStrategy
from ms_llm.strategy.plan import plan
from ms_llm.strategy.search import SearchSpace, search

L7B = load_job(CONFIG_ROOT / "train" / "llama2_7b_dp8_zero1.yaml")
GQA = dataclasses.replace(L7B.model, num_kv_heads=8)          # LLaMA-3-like: 32 query heads, 8 kv heads


def make(cp: int, algorithm: str = "auto", model=L7B.model, seq_len: int = 4096, tp: int = 1):
    s = {"tp": tp, "cp": cp, "context_parallel": {"algorithm": algorithm}}
    return plan(model, from_dict(ParallelStrategy, s, "strategy"),
                dataclasses.replace(L7B.train, seq_len=seq_len), 8)


def test_ring_and_ulysses_activations_fall_as_one_over_cp_allgather_keeps_the_sequence_kv_and_mask():
    one = memory(make(1)).activations
    for cp in (2, 4, 8):
        assert memory(make(cp, "ring")).activations == pytest.approx(one / cp)
        assert memory(make(cp, "ulysses")).activations == pytest.approx(one / cp)
    m, t = L7B.model, make(4).train
    extra = memory(make(4, "allgather")).activations - memory(make(4, "ring")).activations
    # The gathered K and V of the other 3/4 of the sequence, per layer, kept for backward, and the
    # (T/4, T) position mask, one per layer (tests/torch/test_torch_cp_memory.py measures both).
    kv_rest = 2 * m.kv_dim * t.seq_len * 3 / 4 * t.micro_batch_size * 2 * m.num_layers
    mask = t.seq_len / 4 * t.seq_len * 2 * m.num_layers
    assert extra == pytest.approx(kv_rest + mask)


@pytest.mark.parametrize("model", [L7B.model, GQA], ids=["mha", "gqa"])
def test_communication_volume_per_algorithm(model):
    cp, p = 4, make(4, "ring", model)
    layer_passes = model.num_layers * p.micro_batches
    tokens = p.train.micro_batch_size * p.train.seq_len / cp
    kv = 2 * tokens * model.kv_dim * 2                                   # local K and V, bf16
    ring = communication(p).bytes_by_axis["cp"]
    assert ring == pytest.approx(3 * (cp - 1) * kv * layer_passes)      # K/V fwd; K/V + dK/dV bwd
    gather = communication(make(4, "allgather", model)).bytes_by_axis["cp"]
    assert gather == pytest.approx(2 * (cp - 1) * kv * layer_passes)
    ulysses = communication(make(4, "ulysses", model)).bytes_by_axis["cp"]
    qkvo = 2 * tokens * (2 * model.hidden_size + 2 * model.kv_dim) * 2   # q, k, v in, output back (kv heads % cp == 0)
    assert ulysses == pytest.approx(qkvo * (cp - 1) / cp * layer_passes)


def test_ulysses_repeats_kv_heads_that_cp_does_not_divide():
    model = dataclasses.replace(L7B.model, num_kv_heads=4)
    moved = communication(make(8, "ulysses", model)).bytes_by_axis["cp"]
    mha = communication(make(8, "ulysses")).bytes_by_axis["cp"]          # 32 kv heads: same bytes as repeated
    assert moved == pytest.approx(mha)


def test_auto_picks_by_price_and_by_what_the_model_allows():
    assert cp_algorithm(make(1)) == "ring"                                # no cp: nothing to choose
    assert cp_algorithm(make(4, "allgather")) == "allgather"              # an explicit choice stands
    # MHA: ulysses moves a third of ring's bytes; with GQA ring's K/V are 4x smaller and hide under attention.
    assert cp_algorithm(make(4)) == "ulysses"
    assert cp_algorithm(make(4, model=GQA)) == "ring"
    few_heads = dataclasses.replace(L7B.model, num_heads=4, num_kv_heads=4)   # 4 heads cannot split over cp 8
    assert cp_algorithm(make(8, model=few_heads)) in ("ring", "allgather")
    odd = make(4, seq_len=4092)                                           # 4092 % 8 != 0: no zigzag split
    assert cp_algorithm(odd) == "ulysses"


def test_search_names_the_algorithm_of_every_cp_candidate():
    t = dataclasses.replace(L7B.train, seq_len=4096, global_batch_size=16)
    result = search(L7B.model, t, 16, DEVICES["h100"], space=SearchSpace(max_cp=4, zero_stages=(1,),
                                                                         recompute=("none",), micro_batch_sizes=(1,)))
    cp = [c for c in result.ranked if c.strategy.cp > 1]
    assert cp and all(c.strategy.context_parallel.algorithm in ("ring", "ulysses", "allgather") for c in cp)
    for c in cp[:8]:                      # none of the other algorithms would be faster
        for other in cp_algorithms(L7B.model, c.strategy, c.train):
            s = dataclasses.replace(c.strategy, context_parallel=ContextParallelSpec(algorithm=other))
            assert estimate(shape_of(L7B.model, s, c.train), DEVICES["h100"]).step_s >= c.estimate.step_s * (1 - 1e-9)
