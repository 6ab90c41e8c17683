"""Layouts follow their tensors through transpose and reshape: every rank's piece of the
transformed tensor is the transform of its piece of the original."""
import numpy as np
import pytest

from ms_llm.errors import StrategyError
from ms_llm.strategy.layout import Replicate, Shard, TensorLayout
from ms_llm.strategy.mesh import MeshSpec

MESH = MeshSpec(("dp", "cp", "tp"), (2, 2, 2))


def piece(full, layout, rank):
    offsets, sizes = layout.shard_box(rank)
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def test_permute_moves_each_split_with_its_dim():
    lay = TensorLayout.build((4, 8, 6, 2), MESH, dp=0, cp=1, tp=2)   # (B, T, heads, hd)
    full = np.arange(np.prod(lay.shape)).reshape(lay.shape)
    out = lay.permute((0, 2, 1, 3))                                  # (B, heads, T, hd)
    assert out.ms_strategy() == (2, 2, 2, 1)
    for r in range(MESH.size):
        assert np.array_equal(piece(full.transpose(0, 2, 1, 3), out, r), piece(full, lay, r).transpose(0, 2, 1, 3))


def test_group_dims_flattens_batch_and_sequence_major_first():
    lay = TensorLayout.build((2, 8, 6), MESH, dp=0, cp=1)            # one sequence per dp rank
    flat = lay.group_dims(((0, 1), (2,)))
    assert flat.shape == (16, 6) and flat.ms_strategy() == (4, 1)
    full = np.arange(np.prod(lay.shape)).reshape(lay.shape)
    for r in range(MESH.size):
        assert np.array_equal(piece(full.reshape(16, 6), flat, r), piece(full, lay, r).reshape(-1, 6))
    batch_only = TensorLayout.build((4, 8, 6), MESH, dp=0).group_dims(((0, 1), (2,)))
    full = np.arange(4 * 8 * 6).reshape(4, 8, 6)
    for r in range(MESH.size):
        assert np.array_equal(piece(full.reshape(32, 6), batch_only, r), piece(full[:, :, :], TensorLayout.build(
            (4, 8, 6), MESH, dp=0), r).reshape(-1, 6))


def test_group_dims_keeps_dim_order_when_it_is_not_mesh_order():
    lay = TensorLayout.build((2, 2, 8), MESH, dp=0, tp=1, cp=2)      # heads (tp) before sequence (cp)
    merged = lay.group_dims(((0,), (1, 2)))
    assert merged.axes_of(1) == ("tp", "cp") and merged.ms_strategy() == (2, 4)
    full = np.arange(np.prod(lay.shape)).reshape(lay.shape)
    for r in range(MESH.size):
        assert np.array_equal(piece(full.reshape(2, 16), merged, r), piece(full, lay, r).reshape(1, -1))


def test_group_dims_inserts_size_one_dims_and_rejects_bad_groups():
    lay = TensorLayout.build((4, 8), MESH, dp=0)
    assert lay.group_dims(((0,), (), (1,))).shape == (4, 1, 8)
    with pytest.raises(StrategyError, match="cover dims"):
        lay.group_dims(((1,), (0,)))
    with pytest.raises(StrategyError, match="permutation"):
        lay.permute((0, 0))


def test_replicate_dim_drops_only_that_split():
    lay = TensorLayout.build((4, 8, 6), MESH, dp=0, cp=1, tp=2)
    out = lay.replicate_dim(1)
    assert out.ms_strategy() == (2, 1, 2)
    assert out.placements == (Shard(0), Replicate(), Shard(2))
