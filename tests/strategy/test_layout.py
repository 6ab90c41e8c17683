"""TensorLayout <-> MindSpore device matrix / tensor map (ms_llm.mindspore.layout) <-> DTensor placements,
and shard boxes."""

import numpy as np
import pytest

from ms_llm.errors import StrategyError
from ms_llm.mindspore.layout import MsLayout, from_ms, to_ms, to_ms_aliases, to_ms_merged
from ms_llm.strategy.layout import Partial, Replicate, Shard, TensorLayout, parse_placement
from ms_llm.strategy.mesh import MeshSpec

MESH = MeshSpec(("dp", "cp", "tp"), (2, 2, 2))
CASES = [
    ((8, 4), {"dp": 0, "tp": 1}),
    ((8, 4), {"dp": 0, "cp": 0}),
    ((8, 4), {"cp": 0, "tp": 0, "dp": 1}),
    ((8, 8, 4), {"dp": 0, "cp": 1, "tp": 1}),
    ((4,), {}),
]


def layouts():
    for shape, shards in CASES:
        yield TensorLayout.build(shape, MESH, **shards)
    yield TensorLayout.build((8, 4), MESH, tp=0, dp=0).with_order(("tp", "cp", "dp"))


def dtensor_reference_piece(full: np.ndarray, layout: TensorLayout, rank: int) -> np.ndarray:
    """DTensor's semantics: walk mesh dims in order (or the given nesting order) and chunk."""
    coords = layout.mesh.coords(rank)
    piece = full
    axes = layout.order or layout.mesh.names
    for axis in axes:
        p = layout.placements[layout.mesh.names.index(axis)]
        if isinstance(p, Shard):
            piece = np.split(piece, layout.mesh.axis_size(axis), axis=p.dim)[coords[axis]]
    return piece


@pytest.mark.parametrize("layout", list(layouts()), ids=lambda l: l.describe())
def test_shard_boxes_tile_the_tensor_like_dtensor(layout):
    full = np.arange(np.prod(layout.shape)).reshape(layout.shape)
    cover = np.zeros(layout.shape, dtype=int)
    for rank in range(MESH.size):
        offsets, sizes = layout.shard_box(rank)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert np.array_equal(full[box], dtensor_reference_piece(full, layout, rank))
        cover[box] += 1
    replicas = MESH.size // np.prod([layout.split_count(d) for d in range(len(layout.shape))])
    assert (cover == replicas).all()


@pytest.mark.parametrize("layout", list(layouts()), ids=lambda l: l.describe())
def test_mindspore_form_round_trips(layout):
    ms = to_ms(layout)
    assert from_ms(layout.shape, ms, MESH.names) == layout


def test_dtensor_form_round_trips():
    for layout in list(layouts())[:-1]:
        assert TensorLayout.from_dtensor(layout.shape, MESH, layout.to_dtensor()) == layout
    partial = TensorLayout((8, 4), MESH, (Shard(0), Replicate(), Partial()))
    assert partial.to_dtensor() == ("S(0)", "R", "P(sum)")
    assert TensorLayout.from_dtensor((8, 4), MESH, partial.to_dtensor()) == partial
    with pytest.raises(StrategyError, match="inner-to-outer"):
        list(layouts())[-1].to_dtensor()
    with pytest.raises(StrategyError, match="cannot parse"):
        parse_placement("Shard(0)")


def test_against_real_torch_placements():
    torch_tensor = pytest.importorskip("torch.distributed.tensor")
    objects = (torch_tensor.Shard(1), torch_tensor.Replicate(), torch_tensor.Partial())
    layout = TensorLayout.from_dtensor((8, 4), MESH, objects)
    assert layout.placements == (Shard(1), Replicate(), Partial("sum"))
    assert layout.to_dtensor() == tuple(str(o) for o in objects)


def test_known_mindspore_tensor_maps():
    # tensor_map value k names dev_matrix[len-1-k]; tuples list the major axis first.
    assert to_ms(TensorLayout.build((8, 4), MESH, dp=0, tp=1)) == MsLayout((2, 2, 2), (2, 0))
    assert to_ms(TensorLayout.build((8, 4), MESH, dp=0, cp=0)) == MsLayout((2, 2, 2), ((2, 1), -1))
    zero = TensorLayout.build((8, 4), MESH, tp=0, dp=0).with_order(("tp", "cp", "dp"))
    assert to_ms(zero) == MsLayout((2, 2, 2), ((0, 2), -1))


def test_merged_form_for_strategy_files():
    mesh = MeshSpec(("dp", "cp", "tp"), (4, 1, 2))
    col = TensorLayout.build((8, 4), mesh, tp=0)
    assert to_ms_merged(col) == MsLayout((4, 2), (0, -1))
    vocab = TensorLayout.build((8, 4), MeshSpec(("dp", "cp", "tp"), (2, 2, 2)), cp=0, tp=0)
    assert to_ms_merged(vocab) == MsLayout((2, 4), (0, -1))
    assert to_ms_merged(TensorLayout.replicated((3,), mesh)) == MsLayout((4, 2), (-1,))
    with pytest.raises(StrategyError, match="non-adjacent"):
        to_ms_merged(TensorLayout.build((8, 4), MESH, dp=0, tp=0))


def test_ms_strategy_and_aliases():
    layout = TensorLayout.build((8, 8, 4), MESH, dp=0, cp=1, tp=1)
    assert layout.ms_strategy() == (2, 4, 1)
    assert to_ms_aliases(layout) == ("dp", ("cp", "tp"), "None")


def test_bad_layouts_are_refused():
    with pytest.raises(StrategyError, match="not divisible"):
        TensorLayout.build((6, 4), MESH, dp=0, cp=0)
    with pytest.raises(StrategyError, match="shards dim 2"):
        TensorLayout.build((6, 4), MESH, dp=2)
    with pytest.raises(StrategyError, match="no axis 'pp'"):
        TensorLayout.build((6, 4), MESH, pp=0)
    with pytest.raises(StrategyError, match="partial"):
        to_ms(TensorLayout((8, 4), MESH, (Partial(), Replicate(), Replicate())))


@pytest.mark.mindspore
def test_against_real_mindspore_layout():
    ms_parallel = pytest.importorskip("mindspore.parallel")
    for layout in layouts():
        aliases = to_ms_aliases(layout)
        if not aliases:
            continue
        real = ms_parallel.Layout(MESH.shape, MESH.names)(*aliases).to_dict()
        ours = to_ms(layout)
        assert tuple(real["device_matrix"]) == ours.dev_matrix
        assert tuple(real["tensor_map"]) == ours.tensor_map
        assert from_ms(layout.shape, MsLayout(tuple(real["device_matrix"]), tuple(real["tensor_map"])),
                       MESH.names) == layout
