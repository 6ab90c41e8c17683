"""Strategy checkpoint files written from our layouts are read by MindSpore's own tools as we
meant them: build_searched_strategy gives back the layouts, and transform_checkpoints /
merge_sliced_parameter rebuild the exact full tensors from per-rank checkpoints cut by our
layouts (with ZeRO's parallel-optimizer split and pipeline stages)."""
import glob

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.init import init_param
from ms_llm.mindspore.lower import stage_param_entries, write_strategy_files
from ms_llm.mindspore.strategy_file import read_strategy_file
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.strategy.plan import plan

MODEL = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=160, max_seq_len=32, dtype="float32")
CASES = {
    "dp2_tp2_zero1": {"dp": 2, "tp": 2, "zero": {"stage": 1}},
    "dp4_zero2": {"dp": 4, "zero": {"stage": 2}},
    "hsdp4x2_zero1": {"dp": 4, "zero": {"stage": 1, "shard_size": 2, "engine": "shared"}},
    "tp2_pp2": {"dp": 1, "tp": 2, "pp": 2},
    "dp2_tp2_pp2_zero1": {"dp": 2, "tp": 2, "pp": 2, "zero": {"stage": 1}},
}


def _plan(name):
    s = from_dict(ParallelStrategy, CASES[name], "strategy")
    dp = s.dp
    return plan(MODEL, s, TrainConfig(global_batch_size=dp * s.pp, micro_batch_size=1, seq_len=16))


def _full(p):
    """Distinct values everywhere (norms too), so a misplaced slice cannot go unnoticed."""
    return {n: init_param(n, q.shape, 1) + np.arange(np.prod(q.shape), dtype=np.float32).reshape(q.shape)
            for n, q in p.params.items()}


def _cut(p, full, folder):
    """Per-rank checkpoints as MindSpore's parallel optimizer holds weights (ZeRO-split slices)."""
    for rank in range(p.world_size):
        stage, local = p.mesh.coords(rank)["pp"], p.stage_rank(rank)
        items = []
        for q in p.params_of_stage(stage):
            _, held = stage_param_entries(p, stage)[q.name]
            offsets, sizes = held.shard_box(local)
            piece = full[q.name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            items.append({"name": q.name, "data": ms.Tensor(np.ascontiguousarray(piece))})
        (folder / f"rank_{rank}").mkdir(parents=True)
        ms.save_checkpoint(items, str(folder / f"rank_{rank}" / f"net_{rank}.ckpt"))


@pytest.mark.parametrize("name", CASES)
def test_build_searched_strategy_reads_our_layouts(name, tmp_path):
    p = _plan(name)
    files = write_strategy_files(p, tmp_path)
    assert len(files) == p.world_size
    zero_split = 0
    for rank, path in enumerate(files):
        stage = p.mesh.coords(rank)["pp"]
        want = {n: e for n, (e, _) in stage_param_entries(p, stage).items()}
        zero_split += sum(e.opt_shard_size > 0 for e in want.values())
        assert read_strategy_file(path) == (want, stage)
        got = ms.parallel.build_searched_strategy(str(path))
        assert set(got) == set(want)
        for pname, entry in want.items():
            lay = got[pname]
            assert tuple(lay.dev_matrix[0].dim) == entry.dev_matrix
            assert tuple(lay.tensor_map[0].dim) == entry.tensor_map
            assert (lay.opt_weight_shard_size, lay.opt_weight_shard_step) == (entry.opt_shard_size,
                                                                               entry.opt_shard_step)
    assert (zero_split > 0) == (p.zero.stage > 0)


@pytest.mark.parametrize("name", CASES)
def test_transform_checkpoints_rebuilds_the_full_tensors(name, tmp_path):
    p = _plan(name)
    full = _full(p)
    files = write_strategy_files(p, tmp_path / "strategy")
    _cut(p, full, tmp_path / "src")
    src_strategy = str(files[0])
    if p.strategy.pp > 1:
        src_strategy = str(tmp_path / "merged_strategy.ckpt")
        ms.parallel.merge_pipeline_strategys(str(tmp_path / "strategy"), src_strategy)
    ms.parallel.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "dst"), "full", src_strategy, None,
                                      output_format="ckpt")
    (out,) = glob.glob(str(tmp_path / "dst" / "rank_0" / "*.ckpt"))
    merged = ms.load_checkpoint(out)
    assert set(merged) == set(full)
    for pname, value in full.items():
        assert np.array_equal(merged[pname].asnumpy(), value), pname


def test_merge_sliced_parameter_follows_a_tensor_parallel_layout(tmp_path):
    p = _plan("tp2_pp2")
    full = _full(p)
    path = write_strategy_files(p, tmp_path)[0]
    strategy = ms.parallel.build_searched_strategy(str(path))
    for q in p.params_of_stage(0):
        slices = []
        for rank in range(p.stage_mesh.size):
            offsets, sizes = q.layout.shard_box(rank)
            piece = full[q.name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            slices.append(ms.Parameter(ms.Tensor(np.ascontiguousarray(piece)), name=q.name))
        merged = ms.parallel.merge_sliced_parameter(slices, strategy)
        assert np.array_equal(merged.asnumpy(), full[q.name]), q.name
