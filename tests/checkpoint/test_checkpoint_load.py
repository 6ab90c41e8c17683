"""The loader's fast paths: threaded chunked reads equal serial ones, edge blocks are checked,
checkpoints from before CRC32C (zlib CRC32 in the index) still load and are still checked,
and the memory tier's seal skips checksums only for the files the keeper verified, unchanged."""
import gc
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from ckpt_helpers import as_version_1, cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, Region, SaveItem
from ms_llm.checkpoint import reader
from ms_llm.checkpoint.storage import transfer
from ms_llm.checkpoint.storage.safetensors_io import read_header
from ms_llm.checkpoint.storage.seal import KEEPER_LOCK, SEAL
from ms_llm.errors import CheckpointError
from ms_llm.run.keeper import seal_new

W = "model.layers.1.mlp.down_proj.weight"


def _save(root, strategy, world, ref, block=256):
    plan = plan_for(strategy, world)
    for rank in reversed(range(world)):
        w = CheckpointWriter(root, rank, world, session="s", block_bytes=block)
        w.save(1, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(plan, rank).items() if p.primary])
        w.close()
    return Checkpoint.open(root)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    ref = reference()
    return ref, _save(tmp_path_factory.mktemp("tp4"), {"tp": 4}, 4, ref).folder


@pytest.mark.parametrize("strategy,world,rank", [({"tp": 2, "pp": 2}, 4, 0), ({"dp": 2, "zero": {"stage": 3}}, 2, 1),
                                                 ({"tp": 4}, 4, 3)])
def test_threaded_chunked_load_equals_serial_and_reference(tp4, monkeypatch, strategy, world, rank):
    ref, folder = tp4
    monkeypatch.setattr(transfer, "CHUNK", 512)         # many chunks per tensor, many threads at once
    monkeypatch.setattr(transfer, "SUB", 96)            # blocks (256 bytes) checked in uneven pieces
    pieces = rank_pieces(plan_for(strategy, world), rank)
    got = {}
    for workers in (1, 4):
        with Checkpoint(folder) as c:
            c.workers = workers
            got[workers] = c.read_pieces(pieces)
    for name, piece in pieces.items():
        assert got[4][name].tobytes() == got[1][name].tobytes() == cut(ref[name], piece.region).tobytes(), name


def test_files_out_of_the_page_cache_load_the_same(tp4):
    """Evicted files take the read-ahead hint path (transfer.prefetch) and load bit for bit."""
    ref, folder = tp4
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    pieces = rank_pieces(plan_for({"tp": 2, "pp": 2}, 4), 2)
    with Checkpoint(folder) as c:
        got = c.read_pieces(pieces)
    for name, piece in pieces.items():
        assert np.array_equal(got[name], cut(ref[name], piece.region)), name


@pytest.mark.parametrize("sub", [96, 1 << 20])
def test_edge_blocks_outside_the_read_are_checked(tp4, monkeypatch, sub):
    """A read that starts mid-block still checks the whole block: a flipped byte just before
    the wanted bytes, in the same checksum block, is reported."""
    monkeypatch.setattr(transfer, "SUB", sub)
    ref, folder = tp4
    with Checkpoint(folder) as c:
        shard = c.entry(W).shards[0]
        span = c._shard(c.entry(W), shard)
    cols = shard.region.sizes[1]
    want = Region((10, 1), (1, cols - 2))                     # row 10 of the first shard but its ends
    before = span.start + 10 * cols * 4 + 1                   # a byte of element (10, 0): not read
    assert (before - span.start) // shard.block == (before + 3 - span.start) // shard.block
    path = folder / shard.file
    data = bytearray(path.read_bytes())
    data[before] ^= 0x40
    path.write_bytes(bytes(data))
    try:
        with Checkpoint(folder) as c, pytest.raises(CheckpointError, match="fails its checksum"):
            c.read(W, want)
    finally:
        data[before] ^= 0x40
        path.write_bytes(bytes(data))
    with Checkpoint(folder) as c:
        assert np.array_equal(c.read(W, want), ref[W][10:11, 1:cols - 1])


def _as_crc32_era(folder) -> None:
    """Rewrite the index as ms_llm wrote it before CRC32C: format version 1 (as_version_1), zlib
    CRC32s per block under "crc32" (the data files are the same)."""
    index = as_version_1(folder)
    for entry in index["tensors"].values():
        for shard in entry["shards"]:
            span = read_header(str(folder / shard["file"]))[0][shard["key"]]
            with open(folder / shard["file"], "rb") as f:
                f.seek(span.start)
                data = f.read(span.nbytes)
            del shard["crc32c"]
            shard["crc32"] = [zlib.crc32(data[i:i + shard["block"]]) for i in range(0, len(data), shard["block"])]
    (folder / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("era", ["crc32c", "crc32"])
def test_both_checksum_eras_load_and_catch_a_flipped_byte(tp4, tmp_path, era):
    ref, saved = tp4
    folder = tmp_path / saved.name
    shutil.copytree(saved, folder)
    if era == "crc32":
        _as_crc32_era(folder)
    pieces = rank_pieces(plan_for({"tp": 2}, 2), 1)
    with Checkpoint(folder) as c:
        assert {s.checksum for e in c.index.tensors.values() for s in e.shards} == {era}
        got = c.read_pieces(pieces)
        c.verify()
    for name, piece in pieces.items():
        assert np.array_equal(got[name], cut(ref[name], piece.region)), name
    with Checkpoint(folder) as c:
        shard = c.entry(W).shards[-1]
        at = c._shard(c.entry(W), shard).start + 5
    path = folder / shard.file
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match=f"{shard.file}: tensor '{W}'.*fails its checksum"):
        c.read_pieces(pieces)


def test_same_layout_load_batches_back_to_back_runs(tp4, tmp_path, monkeypatch):
    """A same-strategy load reads a rank's file front to back in batches (one preadv into many
    destinations): split at IOV destinations, resumed after short reads, and a flipped byte in
    one small tensor inside a batch is named by that tensor."""
    ref, saved = tp4
    pieces = rank_pieces(plan_for({"tp": 4}, 4), 3)
    batches = []
    monkeypatch.setattr(transfer, "IOV", 3)
    monkeypatch.setattr(transfer.Batch, "run", lambda self, checked, run=transfer.Batch.run: (
        batches.append(len(self.parts)), run(self, checked))[1])
    real = os.preadv
    monkeypatch.setattr(transfer.os, "preadv", lambda fd, views, *args: real(
        fd, views, *args) if len(args) > 1 else real(fd, [v[:max(1, len(v) // 2)] for v in views[:1]], *args))
    with Checkpoint(saved) as c:
        got = c.read_pieces(pieces)
    for name, piece in pieces.items():
        assert got[name].tobytes() == cut(ref[name], piece.region).tobytes(), name
    assert max(batches) == 3 and len(batches) < len(pieces)
    monkeypatch.undo()
    folder = tmp_path / saved.name
    shutil.copytree(saved, folder)
    small = "model.layers.1.input_layernorm.weight"
    with Checkpoint(folder) as c:
        shard = c.entry(small).shards[0]
        at = c._shard(c.entry(small), shard).start + 3
    data = bytearray((folder / shard.file).read_bytes())
    data[at] ^= 0x01
    (folder / shard.file).write_bytes(bytes(data))
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match=f"tensor '{small}'.*fails its checksum"):
        c.read_pieces(pieces)


def test_a_reshard_reads_split_rows_in_batches_and_checks_them(tp4, tmp_path, monkeypatch):
    """Merging tp4 row-parallel shards into tp2 copies boxes out of whole saved rows: those
    rows join the file's batches (one preadv with the runs around them, into scratch), are
    checked there, and a flipped byte in them is named by their tensor."""
    ref, saved = tp4
    pieces = rank_pieces(plan_for({"tp": 2}, 2), 0)
    kinds = []
    monkeypatch.setattr(transfer.Batch, "run", lambda self, checked, run=transfer.Batch.run: (
        kinds.append({type(m).__name__ for m, *_ in self.parts}), run(self, checked))[1])
    with Checkpoint(saved) as c:
        got = c.read_pieces(pieces)
    for name, piece in pieces.items():
        assert got[name].tobytes() == cut(ref[name], piece.region).tobytes(), name
    assert {"BoxMove", "RunMove"} in kinds, kinds
    monkeypatch.undo()
    folder = tmp_path / saved.name
    shutil.copytree(saved, folder)
    with Checkpoint(folder) as c:
        shard = c.entry(W).shards[1]
        at = c._shard(c.entry(W), shard).start + shard.block + 7
    data = bytearray((folder / shard.file).read_bytes())
    data[at] ^= 0x04
    (folder / shard.file).write_bytes(bytes(data))
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match=f"tensor '{W}'.*fails its checksum"):
        c.read_pieces(pieces)


def test_a_load_hints_the_kernel_only_for_files_it_does_not_read_on_to_their_end(tp4, monkeypatch):
    """Batches of a file a load reads without a gap on to its end are left to the kernel's
    sequential readahead; the other files' batches ask for their bytes (transfer.prefetch)."""
    ref, folder = tp4
    hinted = []
    monkeypatch.setattr(transfer, "prefetch", lambda fd, offset, n, real=transfer.prefetch: (
        hinted.append(fd), real(fd, offset, n))[1])
    for strategy, world, rank, streams, hints in [({"tp": 4}, 4, 3, {"rank_00003"}, {"rank_00000"}),
                                                  ({"tp": 2, "pp": 2}, 4, 0, set(), {"rank_00000", "rank_00001"})]:
        hinted.clear()
        pieces = rank_pieces(plan_for(strategy, world), rank)
        with Checkpoint(folder, rank=rank) as c:
            got = c.read_pieces(pieces)
            files = {f.fd: f.path.stem for f in c._files.values()}
        for name, piece in pieces.items():
            assert got[name].tobytes() == cut(ref[name], piece.region).tobytes(), name
        assert {files[fd] for fd in hinted} == hints and set(files.values()) == streams | hints, strategy


def test_chunks_that_cut_checksum_blocks_follow_the_same_hint_rule(tp4, monkeypatch):
    """A read that starts inside a checksum block goes through read_checked, not a Batch: it too
    leaves a file it reads on to its end to the kernel's readahead, and hints any other."""
    ref, folder = tp4
    hinted = []
    monkeypatch.setattr(transfer, "prefetch", lambda fd, offset, n, real=transfer.prefetch: (
        hinted.append(n), real(fd, offset, n))[1])
    with Checkpoint(folder) as c:
        name, last = max(((n, s) for n in c.names() for s in c.entry(n).shards if s.file == "rank_00003.safetensors"),
                         key=lambda found: found[1].start)
        numel = last.region.numel
        assert last.start + numel * 4 == (folder / last.file).stat().st_size
        row = last.region.sizes[-1] * 4
        # Elements [1, stop) of the shard: a row less its first element and one less its last, each
        # inside a checksum block (read_checked), the whole rows between (a Batch).
        for stop, hints in ((numel, []), (numel - 1, [row - 4, row - 4, numel * 4 - 2 * row])):
            hinted.clear()
            want = Region(last.region.offsets, last.region.sizes, (1, stop))
            c._checked = transfer.Checked()
            assert c.read(name, want).tobytes() == cut(ref[name], want).tobytes()
            assert sorted(hinted) == hints, stop


def test_streamed_files_are_read_without_a_gap_on_to_their_end():
    def move(fd, src, nbytes, file_size=100):
        shard = transfer.Shard(Path(f"f{fd}"), fd, 10, 90, 0, (), "crc32c", "t", "k", file_size)
        return transfer.RunMove(shard, src, np.empty(nbytes, np.uint8), 0, nbytes)
    assert transfer.streamed([move(3, 40, 50), move(3, 0, 40)]) == {3}             # in any order
    assert transfer.streamed([move(3, 20, 70), move(3, 30, 10), move(4, 0, 89)]) == {3}   # overlaps; 4 stops short
    assert transfer.streamed([move(3, 0, 40), move(3, 41, 49)]) == set()           # a gap
    assert transfer.streamed([move(3, 50, 40)]) == {3}                             # the tail only


def test_a_load_parses_only_the_shards_it_reads(tp4):
    """A same-strategy load parses one index entry per tensor, a reshard the entries of the
    shards it reads from: at N ranks a tensor has N."""
    ref, folder = tp4
    for strategy, world, rank, most in (({"tp": 4}, 4, 3, 1), ({"tp": 2}, 2, 1, 2)):
        pieces = rank_pieces(plan_for(strategy, world), rank)
        with Checkpoint(folder) as c:
            got = c.read_pieces(pieces)
            parsed = {n: sum(s is not None for s in c.index.tensors[n].shards._parsed) for n in pieces}
        assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items())
        assert max(parsed.values()) == most and len(c.index.tensors[W].shards) == 4, parsed


def test_split_values_shared_by_tensors_are_checked_for_each(tp4, tmp_path):
    """A layout's tensors repeat the same `parts` runs and `split` in the head, and a load parses
    each distinct value once: a malformed one is still refused for every tensor that holds it,
    each refusal naming its own tensor, while the tensors holding a well-formed one read exactly."""
    ref, folder = tp4
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    head = json.loads((copy / "index.json").read_text())
    bad = [f"model.layers.{i}.mlp.gate_proj.weight" for i in (0, 1)]
    for name in bad:
        head["tensors"][name]["split"] = [[0, 32.0, [[1, 4]]]]
    (copy / "index.json").write_text(json.dumps(head))
    pieces = rank_pieces(plan_for({"tp": 2, "pp": 2}, 4), 0)
    good = [n for n in pieces if n.endswith("up_proj.weight")]
    with Checkpoint(copy, rank=0) as c:
        first = c.read_pieces({good[0]: pieces[good[0]]})       # its split text parsed first
        for name in bad:
            with pytest.raises(CheckpointError, match=rf"tensor '{name}': 'split\[1\]' is 32.0"):
                c.read_pieces({name: pieces[name]})
        got = first | c.read_pieces({n: pieces[n] for n in good[1:]})
    assert len(good) > 1 and all(np.array_equal(got[n], cut(ref[n], pieces[n].region)) for n in good)


def test_parsing_and_planning_a_load_pause_the_collector(tp4, monkeypatch):
    """The index parse and the planning allocate thousands of acyclic objects: with the
    collector on, each of its thresholds would traverse them again. At a threshold low enough
    to start dozens of collections in each (88 in this open), they run at most the ones that
    fall due after the pause; the collector is left as found, also after an error."""
    ref, folder = tp4
    pieces = rank_pieces(plan_for({"tp": 2, "pp": 2}, 4), 0)
    started, planned = [], []

    class Moves(reader.Mover):
        def __init__(self, *args):
            planned.append(len(started))        # every read is planned before the Mover starts
            super().__init__(*args)

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])
    monkeypatch.setattr(reader, "Mover", Moves)
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(20)
    gc.callbacks.append(record)
    try:
        with Checkpoint(folder) as c:
            opened = len(started)
            got = c.read_pieces(pieces)
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    assert all(np.array_equal(got[n], cut(ref[n], p.region)) for n, p in pieces.items())
    assert opened <= 3 and planned[0] - opened <= 2, (opened, planned)
    assert gc.isenabled()
    gc.disable()
    try:
        with Checkpoint(folder) as c:
            c.read_pieces(pieces)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match="does not fit"):
        c.read_pieces({W: Region((0, 0), (10 ** 6, 1))})
    assert gc.isenabled()

def _tier(tmp_path):
    """A memory-tier root (the keeper's lock file marks one) holding one committed checkpoint."""
    ref = reference()
    root = tmp_path / "tier"
    root.mkdir()
    (root / KEEPER_LOCK).touch()
    ckpt = _save(root, {"tp": 2}, 2, ref)
    return ref, root, ckpt.folder


def _trusted(folder) -> list[bool]:
    with Checkpoint(folder) as c:
        c.read_full(W)
        return [not s.sums for s in c._shards.values()]


def test_keeper_seal_skips_checksums_until_a_file_changes(tmp_path):
    ref, root, folder = _tier(tmp_path)
    assert _trusted(folder) == [False, False]                # not sealed yet: every block checked
    seal_new(root, set())
    assert (folder / SEAL).is_file() and _trusted(folder) == [True, True]
    with Checkpoint(folder) as c:
        assert np.array_equal(c.read_full(W), ref[W])
    # Writing a file after the seal changes its ctime: it is checked again, and the damage found.
    shard = folder / "rank_00001.safetensors"
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size - 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match="rank_00001.safetensors.*fails its checksum"):
        c.read_pieces(rank_pieces(plan_for({"dp": 1}, 1), 0))
    # Truncated after the seal: refused when the header is read.
    shard.write_bytes(shard.read_bytes()[:-100])
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match="truncated"):
        c.read_pieces(rank_pieces(plan_for({"dp": 1}, 1), 0))


def test_keeper_refuses_to_seal_a_corrupt_checkpoint(tmp_path, capsys):
    _, root, folder = _tier(tmp_path)
    shard = folder / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x08
    shard.write_bytes(bytes(data))
    failed = set()
    seal_new(root, failed)
    assert not (folder / SEAL).exists() and failed == {folder}
    out = capsys.readouterr().out
    assert "not sealed" in out and "fails its checksum" in out
    with Checkpoint(folder) as c, pytest.raises(CheckpointError, match="fails its checksum"):
        c.verify()


def test_seal_counts_only_in_a_memory_tier_and_when_well_formed(tmp_path):
    _, root, folder = _tier(tmp_path)
    seal_new(root, set())
    (root / KEEPER_LOCK).unlink()                           # a disk root: seals are ignored
    assert _trusted(folder) == [False, False]
    (root / KEEPER_LOCK).touch()
    for bad in ({"files": {"rank_00000.safetensors": [1, 2]}}, {"files": []}, [1], "x"):
        (folder / SEAL).write_text(json.dumps(bad))
        assert _trusted(folder) == [False, False]
    (folder / SEAL).write_text("{not json")
    assert _trusted(folder) == [False, False]
