"""Rank arithmetic as pure functions: Megatron's and torchtitan's orders are ours."""
import doctest

import pytest

import ms_llm.strategy.mesh as mesh_module
from ms_llm.errors import StrategyError
from ms_llm.strategy.mesh import MeshSpec, coords_to_rank, rank_groups, rank_to_coords


def test_docstring_examples():
    assert doctest.testmod(mesh_module).failed == 0


def test_coords_round_trip():
    shape = (2, 3, 4)
    for r in range(24):
        assert coords_to_rank(rank_to_coords(r, shape), shape) == r


def test_megatron_order_tp_cp_dp_pp():
    # 16 ranks, tp2 cp2 dp2 pp2. Megatron (order "tp-cp-ep-dp-pp", innermost first) gives
    # tp groups [0,1],[2,3].., cp groups [0,2],[1,3].., dp groups [0,4],.., pp groups [0,8],..
    m = MeshSpec(("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 1, 2, 2))
    assert m.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert m.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert m.groups("dp")[:2] == [[0, 4], [1, 5]]
    assert m.groups("pp")[0] == [0, 8]
    assert m.groups("dp_cp")[0] == [0, 2, 4, 6]
    assert m.index_in("dp_cp", 6) == 3 and m.coords(11) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 1, "tp": 1}


def test_every_rank_in_exactly_one_group():
    m = MeshSpec(("a", "b", "c"), (2, 3, 2))
    for axis in ("a", "b", "c"):
        flat = sorted(r for g in m.groups(axis) for r in g)
        assert flat == list(range(12))
    assert rank_groups((2, 3, 2), (0, 1, 2)) == [list(range(12))]


def test_unknown_axis():
    with pytest.raises(StrategyError, match="no axis 'ep'"):
        MeshSpec(("dp", "tp"), (2, 2)).groups("ep")
