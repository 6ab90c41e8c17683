"""The shared checkpoint format in one process: boxes, safetensors files, save/load, commit."""
import json
import struct
import math
import re
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from ckpt_helpers import STATES, TINY, as_version_1, cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, Piece, Region, SaveItem, flat_pieces, run_config
from ms_llm.checkpoint.storage import commit as commit_mod
from ms_llm.checkpoint.storage.boxes import byte_run
from ms_llm.checkpoint.storage.commit import committed, latest
from ms_llm.checkpoint.storage.index_parts import Grid, savers_meeting
from ms_llm.checkpoint.storage.safetensors_io import bf16_to_f32, f32_to_bf16, read_header
from ms_llm.errors import CheckpointError


def test_flat_region_pieces_cover_exactly_the_run():
    rng = np.random.default_rng(0)
    for _ in range(300):
        shape = tuple(int(s) for s in rng.integers(1, 5, size=rng.integers(1, 4)))
        n = math.prod(shape)
        a = int(rng.integers(0, n + 1))
        b = int(rng.integers(a, n + 1))
        full = np.arange(n).reshape(shape)
        got = np.full(b - a, -1)
        pieces = Region((0,) * len(shape), shape, (a, b)).pieces()
        assert len(pieces) <= 2 * len(shape) - 1 or b == a
        for p in pieces:
            box = full[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))].reshape(-1)
            got[p.start:p.start + p.numel] = box
        assert np.array_equal(got, full.reshape(-1)[a:b])


def test_byte_run_only_for_contiguous_boxes():
    from ms_llm.checkpoint.storage.boxes import SubBox
    within = SubBox((0, 10, 0), (4, 5, 6), 0)
    # rows 2..4 of block 1, all columns: one run of 18 elements
    assert byte_run(((1, 12, 0), (1, 3, 6)), within, 4) == ((1 * 30 + 2 * 6) * 4, (1 * 30 + 5 * 6) * 4)
    assert byte_run(((1, 10, 0), (2, 5, 6)), within, 4) == (120, 360)          # whole blocks 1, 2
    assert byte_run(((0, 10, 0), (4, 5, 6)), within, 2) == (0, 240)            # the whole sub-box
    assert byte_run(((1, 12, 2), (1, 1, 3)), within, 4) == ((30 + 12 + 2) * 4, (30 + 12 + 5) * 4)
    assert byte_run(((1, 12, 0), (2, 2, 6)), within, 4) is None               # two rows of two blocks
    assert byte_run(((1, 12, 0), (1, 2, 5)), within, 4) is None               # rows cut short
    assert byte_run(((), ()), SubBox((), (), 0), 8) == (0, 8)                  # a scalar


def test_bfloat16_rounding_matches_torch():
    x = torch.randn(10000) * 100
    ours = f32_to_bf16(x.numpy())
    assert np.array_equal(ours, x.bfloat16().view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(bf16_to_f32(ours), x.bfloat16().float().numpy())


def _save(root, plan, ref, step=1, **kw):
    """Save `ref` as every rank of `plan` would (rank 0 last: it commits)."""
    for rank in reversed(range(plan.world_size)):
        w = CheckpointWriter(root, rank, plan.world_size, session=f"s{step}", **kw)
        items = [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(plan, rank).items()]
        w.save(step, items, state={"step": step, "sampler": {"epoch": 0, "position": 8 * step}},
               rank_state={"rng": bytes([rank, step])}, config=run_config(plan, "test"))
        w.close()
    return Checkpoint.open(root)


def test_round_trip_and_files_are_standard_safetensors(tmp_path):
    ref = reference()
    plan = plan_for({"dp": 2, "tp": 2, "zero": {"stage": 1}}, 4)
    ckpt = _save(tmp_path, plan, ref, step=3)
    assert ckpt.step == 3 and ckpt.state == {"step": 3, "sampler": {"epoch": 0, "position": 24}}
    assert ckpt.rank_state(2) == {"rng": bytes([2, 3])} and ckpt.model_config() == TINY
    for name in ref:
        assert np.array_equal(ckpt.read_full(name), ref[name]), name
    ckpt.verify()
    for f in ckpt.folder.glob("rank_*.safetensors"):       # the safetensors package reads our files
        for key, value in safetensors.numpy.load_file(str(f)).items():
            assert value.dtype == np.float32
    # Only primary copies were written: the shards hold each element exactly once.
    stored = sum(np.prod(s.region.shape) for e in ckpt.index.tensors.values() for s in e.shards)
    assert stored == sum(a.size for a in ref.values())


def test_read_any_region_including_flat_runs(tmp_path):
    ref = reference()
    ckpt = _save(tmp_path, plan_for({"tp": 4}, 4), ref)
    w = ref["model.layers.1.mlp.down_proj.weight"]           # row-parallel: columns split over 4 files
    got = ckpt.read("model.layers.1.mlp.down_proj.weight", Region((5, 7), (20, 50)))
    assert np.array_equal(got, w[5:25, 7:57])
    got = ckpt.read("model.layers.1.mlp.down_proj.weight", Region((8, 0), (16, 128), (100, 1500)))
    assert np.array_equal(got, w[8:24].reshape(-1)[100:1500])


def test_flat_buffer_pieces_save_and_load(tmp_path):
    """ZeRO flat-buffer slices mapped back to named tensors round-trip exactly."""
    ref = {"a": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.arange(10, dtype=np.float32) + 100}
    members = [(Piece("a", (4, 6), Region((0, 0), (4, 6))), 0), (Piece("b", (10,), Region((0,), (10,))), 24)]
    world = 4
    per = -(-34 // world)                                    # buffer padded to 36
    for rank in reversed(range(world)):
        pieces = flat_pieces(members, rank * per, (rank + 1) * per)
        w = CheckpointWriter(tmp_path, rank, world, session="flat")
        w.save(1, [SaveItem(p, cut(ref[p.name], p.region)) for p in pieces])
        w.close()
    ckpt = Checkpoint.open(tmp_path)
    assert np.array_equal(ckpt.read_full("a"), ref["a"]) and np.array_equal(ckpt.read_full("b"), ref["b"])
    assert np.array_equal(ckpt.read("a", Region((1, 2), (2, 3))), ref["a"][1:3, 2:5])


def test_bfloat16_tensors_round_trip(tmp_path):
    bits = f32_to_bf16(np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32))
    w = CheckpointWriter(tmp_path, 0, 1)
    w.save(1, [SaveItem(Piece("x", (8, 4), Region((0, 0), (8, 4))), bits, "bfloat16")])
    w.close()
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.entry("x").dtype == "bfloat16" and np.array_equal(ckpt.read_full("x"), bits)
    spans, _, _ = read_header(str(ckpt.folder / "rank_00000.safetensors"))
    assert spans["x"].dtype == "bfloat16"


def test_retention_latest_and_second_save_waits(tmp_path):
    ref = {"x": np.arange(6, dtype=np.float32)}
    w = CheckpointWriter(tmp_path, 0, 1, keep_last=2, session="r")
    piece = Piece("x", (6,), Region((0,), (6,)))
    for step in (10, 20, 30, 40):
        stats = w.save(step, [SaveItem(piece, ref["x"] + step)])
        assert stats.stall_s >= stats.wait_s
    w.close()
    assert [p.name for p in committed(tmp_path)] == ["step_00000040", "step_00000030"]
    assert latest(tmp_path).name == "step_00000040"
    assert np.array_equal(Checkpoint.open(tmp_path).read_full("x"), ref["x"] + 40)
    assert w.last.total_s >= w.last.stall_s > 0


def test_an_overlapped_save_copies_beside_training_and_the_fence_waits_for_the_copy(tmp_path):
    """save(overlap=True) returns while a copy is still running (the next step's forward and
    backward go on meanwhile); fence() blocks until the snapshot is taken, so the update after
    it is not in the checkpoint, and the stall counted, here and in the record, is what fence waited."""
    weights = np.arange(6, dtype=np.float32)
    release = threading.Event()

    def slow_copy(dst: np.ndarray) -> None:
        assert release.wait(10)
        dst[...] = weights
    w = CheckpointWriter(tmp_path, 0, 1, session="o")
    stats = w.save(1, [SaveItem(Piece("x", (6,), Region((0,), (6,))), slow_copy, "float32")], overlap=True)
    assert not stats.copied.is_set() and stats.stall_s == 0.0
    threading.Timer(0.2, release.set).start()
    w.fence()
    assert stats.copied.is_set() and stats.stall_s >= 0.15
    weights += 100                                    # the optimizer's update, after the fence
    w.close()
    ckpt = Checkpoint.open(tmp_path)
    assert np.array_equal(ckpt.read_full("x"), np.arange(6, dtype=np.float32))
    assert ckpt.index.save_stats["stall_s"] == stats.stall_s


def test_fragments_of_another_session_are_not_committed(tmp_path):
    """A crashed attempt's fragment of rank 1 must not be merged into a later save."""
    piece0 = Piece("x", (4,), Region((0,), (2,)))
    piece1 = Piece("x", (4,), Region((2,), (2,)))
    old = CheckpointWriter(tmp_path, 1, 2, session="attempt0")
    old.save(5, [SaveItem(piece1, np.array([9, 9], dtype=np.float32))])
    old.close()
    w0 = CheckpointWriter(tmp_path, 0, 2, session="attempt1", commit_timeout_s=0.5)
    w0.save(5, [SaveItem(piece0, np.array([1, 2], dtype=np.float32))])
    with pytest.raises(CheckpointError, match="waiting for 2 rank fragments"):
        w0.wait()
    assert latest(tmp_path) is None
    w1 = CheckpointWriter(tmp_path, 1, 2, session="attempt1")
    w1.save(5, [SaveItem(piece1, np.array([3, 4], dtype=np.float32))])
    w1.close()
    w0 = CheckpointWriter(tmp_path, 0, 2, session="attempt1")
    w0.save(5, [SaveItem(piece0, np.array([1, 2], dtype=np.float32))])
    w0.close()
    assert Checkpoint.open(tmp_path).read_full("x").tolist() == [1, 2, 3, 4]


def test_the_commit_parses_each_fragment_once_while_it_waits(tmp_path, monkeypatch):
    """Rank 0's commit polls until the slowest rank's fragment appears; the ones already there
    are parsed once, not at every poll (at 64 ranks each poll parsed up to 63)."""
    reads = Counter()
    read_text = Path.read_text

    def counted(self, *args, **kwargs):
        if re.fullmatch(r"rank_\d{5}\.json", self.name):
            reads[self.name] += 1
        return read_text(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", counted)
    pieces = [Piece("x", (6,), Region((2 * r,), (2,))) for r in range(3)]
    writers = {}
    for rank in (2, 0, 1):
        if rank == 1:                                   # the slow rank: rank 0 has been polling
            deadline = time.monotonic() + 10
            while reads["rank_00001.json"] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        writers[rank] = CheckpointWriter(tmp_path, rank, 3, session="s")
        writers[rank].save(1, [SaveItem(pieces[rank], np.full(2, rank, np.float32))])
        if rank == 2:                                   # its fragment is there before rank 0's commit polls
            writers[rank].wait()
    for w in writers.values():
        w.close()
    assert Checkpoint.open(tmp_path).read_full("x").tolist() == [0, 0, 1, 1, 2, 2]
    assert reads["rank_00000.json"] == reads["rank_00002.json"] == 1 and reads["rank_00001.json"] >= 4, reads


def test_a_large_commit_runs_in_a_child_process(tmp_path, monkeypatch):
    """Rank 0's commit holds the interpreter lock the training thread needs between its ops:
    from CHILD_SHARDS shards on it runs in a child process (an in-process commit fails here),
    and the child's CheckpointError comes back to the writer."""
    world = 4

    def in_process(*args, **kwargs):
        raise AssertionError("committed in the training process")
    monkeypatch.setattr(commit_mod, "CHILD_SHARDS", 2 * world)
    monkeypatch.setattr(commit_mod, "commit", in_process)
    pieces = [[Piece(n, (2 * world,), Region((2 * r,), (2,))) for n in "xy"] for r in range(world)]
    for rank in reversed(range(world)):
        w = CheckpointWriter(tmp_path / "ok", rank, world, session="s")
        w.save(3, [SaveItem(p, np.full(2, rank, np.float32)) for p in pieces[rank]])
        w.close()
    assert Checkpoint.open(tmp_path / "ok").read_full("y").tolist() == [r for r in range(world) for _ in (0, 1)]
    w0 = CheckpointWriter(tmp_path / "late", 0, world, session="s", commit_timeout_s=0.3)
    w0.save(3, [SaveItem(p, np.zeros(2, np.float32)) for p in pieces[0]])
    with pytest.raises(CheckpointError, match=f"waiting for {world} rank fragments of this save"):
        w0.wait()
    assert latest(tmp_path / "late") is None
    monkeypatch.setattr(commit_mod, "CHILD_SHARDS", 2 * world + 1)       # one shard fewer: committed in process
    with pytest.raises(CheckpointError, match="committed in the training process"):
        for rank in reversed(range(world)):
            w = CheckpointWriter(tmp_path / "small", rank, world, session="s")
            w.save(3, [SaveItem(p, np.zeros(2, np.float32)) for p in pieces[rank]])
            w.close()

def test_bad_items_are_named(tmp_path):
    w = CheckpointWriter(tmp_path, 0, 1)
    with pytest.raises(CheckpointError, match=r"x: local tensor has shape \(3,\)"):
        w.save(1, [SaveItem(Piece("x", (4,), Region((0,), (4,))), np.zeros(3, dtype=np.float32))])
    with pytest.raises(CheckpointError, match="x: local tensor is float64"):
        w.save(1, [SaveItem(Piece("x", (4,), Region((0,), (4,))), np.zeros(4), "float32")])


def _corrupt(folder, mode):
    f = sorted(folder.glob("rank_*.safetensors"))[1]
    data = bytearray(f.read_bytes())
    if mode == "flip":
        data[-5] ^= 0x10
    else:
        data = data[:len(data) - 100]
    f.write_bytes(bytes(data))
    return f


@pytest.mark.parametrize("mode,message", [("flip", "fails its checksum"), ("truncate", "truncated")])
def test_corruption_is_detected_and_previous_checkpoint_loads(tmp_path, mode, message):
    from ms_llm.checkpoint import load_with_fallback, candidates

    ref = reference()
    plan = plan_for({"tp": 2}, 2)
    _save(tmp_path, plan, ref, step=1, keep_last=3)
    newer = {n: a + 1 for n, a in ref.items()}
    ckpt = _save(tmp_path, plan, newer, step=2, keep_last=3)
    bad = _corrupt(ckpt.folder, mode)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(ckpt.folder).verify()
    assert message in str(err.value) and bad.name in str(err.value) and "tensor '" in str(err.value)
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    used, arrays = load_with_fallback(candidates(tmp_path), lambda c: c.read_pieces(pieces))
    assert used.step == 1
    assert all(np.array_equal(arrays[n], ref[n]) for n in pieces)


def test_missing_tensor_and_wrong_model_are_clear(tmp_path):
    ref = reference()
    plan = plan_for({"dp": 1}, 1)
    w = CheckpointWriter(tmp_path, 0, 1)
    w.save(1, [SaveItem(p, ref[n]) for n, p in rank_pieces(plan, 0).items() if "optim" not in n])
    w.close()
    ckpt = Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="lacks 78 wanted tensor"):
        ckpt.read_pieces(rank_pieces(plan, 0))
    assert len(ckpt.read_pieces(rank_pieces(plan, 0), strict=False)) == len(plan.params)
    with pytest.raises(CheckpointError, match="does not fit"):
        ckpt.read("model.norm.weight", Region((0,), (65,)))
    with pytest.raises(CheckpointError, match="neither a checkpoint folder"):
        Checkpoint.open(tmp_path / "nowhere")


@pytest.mark.parametrize("strategy,world", [
    ({"dp": 4, "zero": {"stage": 3}}, 4), ({"tp": 2, "pp": 2}, 4), ({"dp": 2, "tp": 2, "zero": {"stage": 2}}, 4),
    ({"dp": 4, "zero": {"stage": 1, "shard_size": 2}}, 4), ({"tp": 4, "sequence_parallel": True}, 4)])
def test_primary_pieces_hold_every_element_once(strategy, world):
    plan = plan_for(strategy, world)
    counts = {}
    for rank in range(world):
        for name, p in rank_pieces(plan, rank).items():
            if p.primary:
                counts[name] = counts.get(name, 0) + p.region.numel
    assert set(counts) == {n for n in reference()} and all(counts[n] == math.prod(
        plan.params[n.split(".", 2)[2] if n.startswith("optim.") else n].shape) for n in counts)


def test_index_is_plain_json_with_layouts(tmp_path):
    ckpt = _save(tmp_path, plan_for({"tp": 2}, 2), reference())
    index = json.loads((ckpt.folder / "index.json").read_text())
    q = index["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    parts = [json.loads((ckpt.folder / f"index_{r:05d}.json").read_text()) for r in range(2)]
    assert q == {"shape": [64, 64], "dtype": "float32", "layout": "tp:S(0)", "parts": [[0, 2]],
                 "split": [[0, 32, [[1, 2]]]]}
    assert index["version"] == 2
    assert [p["tensors"]["model.layers.0.self_attn.q_proj.weight"][0]["offsets"] for p in parts] == [[0, 0], [32, 0]]
    for rank, part in enumerate(parts):         # each shard's `start`: where the safetensors header puts its bytes
        raw = (ckpt.folder / f"rank_{rank:05d}.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        starts = {s["key"]: s["start"] for shards in part["tensors"].values() for s in shards}
        assert starts == {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    assert [p["bytes"] for p in index["parts"]] == [(ckpt.folder / f"index_{r:05d}.json").stat().st_size
                                                    for r in range(2)]
    assert index["config"]["strategy"]["tp"] == 2 and index["world_size"] == 2
    assert set(STATES) == {n.split(".")[1] for n in index["tensors"] if n.startswith("optim.")}


@pytest.mark.parametrize("strategy", [{"dp": 2, "tp": 2}, {"tp": 2, "pp": 2},
                                      {"dp": 4, "zero": {"stage": 1, "shard_size": 2}}])
def test_a_same_layout_load_reads_its_own_index_parts_only(tmp_path, strategy):
    """Each rank of a 4-rank save resumes with only its own index part and those its record
    names in `also` (where the replicas it did not save are) left in the folder; without the
    rank, the load reads the parts of every rank that saved a tensor it wants. A reshard and a
    version-1 index read the same values."""
    ref, plan = reference(), plan_for(strategy, 4)
    saved = _save(tmp_path / "ckpt", plan, ref).folder
    head = json.loads((saved / "index.json").read_text())
    also = [set(record["also"]) for record in head["parts"]]
    assert any(also) and all(rank not in a for rank, a in enumerate(also))
    hint_matters = []
    for rank in range(4):
        folder = tmp_path / f"rank{rank}" / saved.name
        shutil.copytree(saved, folder)
        for other in set(range(4)) - {rank} - also[rank]:
            (folder / f"index_{other:05d}.json").unlink()
        pieces = rank_pieces(plan, rank)
        with Checkpoint(folder, rank=rank) as c:
            got = c.read_pieces(pieces)
        assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items()), rank
        holders = {r for n in pieces for a, b in head["tensors"][n]["parts"] for r in range(a, b)}
        hint_matters.append(bool(holders - {rank} - also[rank]))
        if hint_matters[-1]:
            with pytest.raises(CheckpointError, match=r"index_\d{5}.json: missing; .* names 4 index parts"):
                Checkpoint(folder).read_pieces(pieces)
    assert any(hint_matters)
    v1 = tmp_path / "v1" / saved.name
    shutil.copytree(saved, v1)
    as_version_1(v1)
    for folder, rank in [(saved, 1), (v1, 1), (v1, None)]:
        for target in (plan, plan_for({"tp": 4}, 4)):
            pieces = rank_pieces(target, rank or 0)
            with Checkpoint(folder, rank=rank) as c:
                got = c.read_pieces(pieces)
            assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items()), (folder, rank)


def test_a_reshard_reads_only_the_parts_of_the_ranks_that_saved_its_tensors(tmp_path):
    """The head names, per tensor, the ranks whose parts hold its shards: a rank of another
    layout that wants one pipeline stage's tensors reads that stage's parts only (here every
    other part is gone from the folder), and a verify still reads them all."""
    ref, saved_plan = reference(), plan_for({"pp": 2, "dp": 2, "zero": {"stage": 1}}, 4)
    folder = _save(tmp_path / "ckpt", saved_plan, ref).folder
    head = json.loads((folder / "index.json").read_text())
    target = plan_for({"tp": 2, "pp": 2}, 4)
    pieces = rank_pieces(target, 0)
    holders = {r for n in pieces for a, b in head["tensors"][n]["parts"] for r in range(a, b)}
    assert holders and len(holders) < 4 and head["tensors"]["lm_head.weight"]["parts"] != [[0, 4]]
    for other in set(range(4)) - holders:
        (folder / f"index_{other:05d}.json").unlink()
    with Checkpoint(folder) as c:
        got = c.read_pieces(pieces)
        assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items())
        with pytest.raises(CheckpointError, match=r"index_\d{5}.json: missing"):
            c.verify()


@pytest.mark.parametrize("saved, target, expect, needed", [
    ({"tp": 4}, {"tp": 2}, {"model.layers.0.self_attn.q_proj.weight": [[0, 16, [[1, 4]]]],
                            "model.layers.0.self_attn.o_proj.weight": [[1, 16, [[1, 4]]]]}, {0, 1}),
    ({"dp": 4, "zero": {"stage": 3}}, {"dp": 2, "zero": {"stage": 3}}, {"lm_head.weight": [[0, 32, [[1, 4]]]]},
     {0, 1}),
    ({"dp": 2, "tp": 2, "zero": {"stage": 3}}, {"tp": 2},
     {"model.layers.0.self_attn.q_proj.weight": [[0, 16, [[2, 2], [1, 2]]]],
      "model.layers.0.self_attn.o_proj.weight": [[0, 32, [[2, 2]]], [1, 32, [[1, 2]]]]}, {0, 2}),
])
def test_a_reshard_of_an_evenly_split_tensor_reads_the_parts_of_the_savers_it_meets(tmp_path, saved, target, expect,
                                                                                     needed):
    """The head says how a tensor's savers tile it evenly (`split`); rank 0 of a layout with
    half as many slices reads the parts of the two savers whose cells its own meets, not all
    four (here the other two are gone), and reads exactly: tensor parallel (columns or rows),
    ZeRO-3, and both, whose savers' slabs interleave (q_proj) or form a grid (o_proj). Without
    `split` (a head from before it) the load reads every saver's part."""
    ref = reference()
    folder = _save(tmp_path / "ckpt", plan_for(saved, 4), ref).folder
    head = json.loads((folder / "index.json").read_text())
    assert {n: head["tensors"][n].get("split") for n in expect} == expect
    pieces = rank_pieces(plan_for(target, 2), 0)
    assert all(head["tensors"][n]["parts"] == [[0, 4]] for n in expect)
    without = tmp_path / "without" / folder.name
    shutil.copytree(folder, without)
    for tensor in head["tensors"].values():
        tensor.pop("split", None)
    (without / "index.json").write_text(json.dumps(head))
    for part in set(range(4)) - needed:
        (folder / f"index_{part:05d}.json").unlink()
        (without / f"index_{part:05d}.json").unlink()
    with Checkpoint(folder, rank=0) as c:
        got = c.read_pieces(pieces)
        assert c.index.parts.parsed() == sorted(needed)
    assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items())
    with pytest.raises(CheckpointError, match=r"index_0000\d.json: missing"):
        Checkpoint(without, rank=0).read_pieces(pieces)


def cells(*boxes):
    """Savers' cuts (Region.cuts) of a 10 x 6 tensor from (row start, row stop, col start, col stop)."""
    return [[c for c in ([0, r0, r1], [1, c0, c1]) if (c[1], c[2]) != (0, (10, 6)[c[0]])] for r0, r1, c0, c1 in boxes]


@pytest.mark.parametrize("savers, split", [
    (cells((0, 4, 0, 6), (4, 8, 0, 6), (8, 10, 0, 6)), [[0, 4, [[1, 3]]]]),              # the last one shorter
    ([[[-1, 0, 30]], [[-1, 30, 60]]], [[-1, 30, [[1, 2]]]]),                              # ZeRO slices
    (cells((0, 3, 0, 6), (6, 9, 0, 6), (3, 6, 0, 6), (9, 10, 0, 6)), [[0, 3, [[2, 2], [1, 2]]]]),   # interleaved
    (cells((0, 5, 0, 3), (0, 5, 3, 6), (5, 10, 0, 3), (5, 10, 3, 6)), [[0, 5, [[2, 2]]], [1, 3, [[1, 2]]]]),  # a grid
    (cells((0, 5, 0, 3), (5, 10, 0, 3), (0, 5, 3, 6), (5, 10, 3, 6)), [[0, 5, [[1, 2]]], [1, 3, [[2, 2]]]]),
    (cells((0, 2, 0, 6), (4, 6, 0, 6), (2, 4, 0, 6), (6, 8, 0, 6), (8, 10, 0, 6)), None),  # interleaved, 5 savers
    (cells((0, 4, 0, 6), (4, 6, 0, 6), (6, 10, 0, 6)), None),             # a shorter one before the end
    (cells((0, 4, 0, 6), (4, 8, 0, 6)), None),                             # not all of it
    (cells((0, 4, 0, 6), (5, 9, 0, 6), (9, 10, 0, 6)), None),              # a gap
    (cells((0, 4, 0, 6), (4, 8, 0, 6), (4, 8, 0, 6), (8, 10, 0, 6)), None),  # one twice
    (cells((0, 5, 0, 6), (0, 10, 0, 3), (0, 10, 3, 6)), None),              # other dimensions
    (cells((0, 5, 0, 3), (5, 10, 3, 6), (0, 5, 3, 6), (5, 10, 0, 3)), None),  # a grid in no mesh's order
    ([[[0, 0, 5]], [[0, 5, 5]], [[0, 5, 10]]], None),                        # an empty slab
    ([[[0, 0, 5]], None], None),                                           # a saver with two shards of it
    (cells((0, 10, 0, 6)), None),                                          # one saver: nothing to narrow
])
def test_an_even_split_is_claimed_only_when_a_mesh_numbers_the_savers_cells(savers, split):
    assert commit_mod.even_split(savers, (10, 6)) == split


def test_the_savers_a_region_meets_come_from_the_rank_runs_in_order():
    holders = (range(0, 2), range(4, 6), range(9, 10))      # savers 0..4 are ranks 0, 1, 4, 5, 9
    rows = [Grid(0, 10, ((1, 5),))]
    assert savers_meeting(holders, rows, [(15, 30)]) == [range(1, 2), range(4, 5)]
    assert savers_meeting(holders, rows, [(15, 31)]) == [range(1, 2), range(4, 5), range(5, 6)]
    assert savers_meeting(holders, rows, [(45, 46)]) == [range(9, 10)]
    interleaved = [Grid(0, 10, ((2, 2), (1, 2)))]             # saver i holds slab (i // 2) + 2 * (i % 2)
    assert savers_meeting((range(4),), interleaved, [(0, 20)]) == [range(0, 1), range(2, 3)]
    grid = [Grid(0, 5, ((2, 2),)), Grid(1, 3, ((1, 2),))]     # saver i holds row slab i // 2, column slab i % 2
    assert savers_meeting((range(4),), grid, [(5, 10), (0, 6)]) == [range(2, 3), range(3, 4)]
    assert savers_meeting((range(4),), grid, [(0, 10), (4, 5)]) == [range(1, 2), range(3, 4)]
    region = Region((0, 2), (6, 4), (3, 17))                 # elements [3, 17) of a 6 x 4 box of a 6 x 10 tensor
    assert region.extent(-1, (6, 10)) == (5, 43) and region.extent(0, (6, 10)) == (0, 6)
    assert Region((0, 0), (6, 10), (3, 17)).cuts((6, 10)) == [(-1, 3, 17)]
    assert Region((2, 0), (2, 10)).cuts((6, 10)) == [(0, 2, 4)] and Region((2, 1), (2, 9), (0, 3)).cuts((6, 10)) is None


def test_the_backend_adapter_hands_the_writer_the_replicas_a_rank_holds(tmp_path):
    """torch_backend's save_items gives the writer every piece a rank holds, the replicas
    another rank saves without data: a save made without the trainer names them in `also` as
    a save of every piece with its data does. The writer refuses a piece the rank saves that
    comes without data."""
    from torch_backend.checkpoint import save_items
    ref, plan = reference(), plan_for({"dp": 2, "tp": 2}, 4)
    for rank in reversed(range(4)):
        pieces = rank_pieces(plan, rank)
        items = save_items(pieces, {n: torch.from_numpy(cut(ref[n], p.region)) for n, p in pieces.items()})
        assert [i.data is None for i in items] == [not p.primary for p in pieces.values()]
        w = CheckpointWriter(tmp_path / "adapter", rank, 4, session="a")
        w.save(1, items)
        w.close()
    _save(tmp_path / "every", plan, ref)

    def also(root):
        return [record["also"] for record in json.loads((latest(root) / "index.json").read_text())["parts"]]
    assert also(tmp_path / "adapter") == also(tmp_path / "every") == [[], [0], [0], [0, 1]]
    primary = next(p for p in rank_pieces(plan, 0).values() if p.primary)
    w = CheckpointWriter(tmp_path / "bad", 0, 1, session="b")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(primary.name)}: this rank saves the piece at offsets "
                                              r"\(0, 0\) \(it is primary\) but its SaveItem has no data$"):
        w.save(1, [SaveItem(primary, None)])
    w.close()


def test_the_commit_reads_only_the_parts_of_the_ranks_that_saved_what_replicas_hold(tmp_path):
    """Under plain data parallelism every rank holds the weights and rank 0 saves them: rank 0's
    commit works out `also` from its own part alone (a part of another rank, here made
    unreadable before the commit, is not opened)."""
    plan, ref = plan_for({"dp": 4}, 4), reference()
    for rank in (3, 2, 1, 0):
        if rank == 0:
            (tmp_path / "step_00000001.tmp" / "index_00003.json").write_text("not json")
        w = CheckpointWriter(tmp_path, rank, 4, session="s")
        w.save(1, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(plan, rank).items()])
        w.close()
    head = json.loads((latest(tmp_path) / "index.json").read_text())
    assert [record["also"] for record in head["parts"]] == [[], [0], [0], [0]]
    assert {tuple(map(tuple, t["parts"])) for t in head["tensors"].values()} == {((0, 1),)}


def test_the_commit_refuses_shards_that_leave_part_of_a_tensor_out(tmp_path):
    """Rank 1 saves all but its half of lm_head.weight: rank 0's commit adds up the elements the
    fragments say were saved, refuses the save, and publishes nothing."""
    plan, ref = plan_for({"tp": 2}, 2), reference()
    for rank in (1, 0):
        w = CheckpointWriter(tmp_path, rank, 2, session="s")
        w.save(1, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(plan, rank).items()
                   if (rank, n) != (1, "lm_head.weight")])
        if rank == 1:
            w.close()
    with pytest.raises(CheckpointError, match=r"step 1: tensor 'lm_head.weight' has 4096 elements in its shards but "
                                              r"shape \(128, 64\) needs 8192"):
        w.close()
    assert latest(tmp_path) is None and committed(tmp_path) == []
