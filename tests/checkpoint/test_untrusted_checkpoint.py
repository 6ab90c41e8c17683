"""Issue 12, checkpoints: names from a checkpoint stay inside its folder, numbers from an index
or a safetensors header are checked before use, and every failure is a CheckpointError that
the resume fallback (load_with_fallback, TrainerCheckpoints._load_agreed) turns into loading
the previous checkpoint. Opens are audited (ckpt_guard), not inferred from error messages."""
import json
import logging
import os
import shutil
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest

from ckpt_guard import confine_opens
from ckpt_helpers import cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, candidates, load_with_fallback, run_config
from ms_llm.checkpoint.interop.hf import export_hf, hf_source
from ms_llm.cli import main
from ms_llm.errors import CheckpointError

PLAN = plan_for({"tp": 2}, 2)
STEP2 = "step_00000002"


def save(root: Path, ref: dict, step: int) -> None:
    for rank in reversed(range(PLAN.world_size)):            # rank 0 last: it commits
        w = CheckpointWriter(root, rank, PLAN.world_size, session=f"s{step}")
        w.save(step, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(PLAN, rank).items()],
               state={"step": step}, rank_state={"rng": bytes([rank])}, config=run_config(PLAN, "test"))
        w.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A root with two committed checkpoints: step 1 (the fallback) and step 2 (tampered with)."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    ref = reference()
    save(root, ref, 1)
    save(root, {n: a + 1 for n, a in ref.items()}, 2)
    return root


@pytest.fixture
def root(pristine, tmp_path) -> Path:
    out = tmp_path / "run" / "checkpoints"
    shutil.copytree(pristine, out)
    return out


def edit_index(folder: Path, edit) -> None:
    """`edit(head, parts)` on index.json and the index parts (by rank), written back with the
    head's part records made to match, as a crafted checkpoint would: the edit reaches the
    checks behind the records."""
    head = json.loads((folder / "index.json").read_text())
    parts = {r: json.loads((folder / f"index_{r:05d}.json").read_text()) for r in range(len(head["parts"]))}
    edit(head, parts)
    for rank, part in parts.items():
        data = json.dumps(part).encode()
        (folder / f"index_{rank:05d}.json").write_bytes(data)
        if isinstance(head.get("parts"), list) and rank < len(head["parts"]):
            head["parts"][rank].update(bytes=len(data), crc32c=crc32c.crc32c(data))
    (folder / "index.json").write_text(json.dumps(head))


def edit_header(path: Path, edit, in_place: bool = False) -> None:
    """`edit(header)` on a safetensors file's header; `in_place` keeps its length (padded), so
    the tensors' bytes stay where they were."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = edit(header) or header
    text = json.dumps(header, separators=(",", ":") if in_place else None).encode()
    text += b" " * ((n - len(text)) if in_place else (-len(text) % 8))
    assert not in_place or len(text) == n
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def without_starts(folder: Path) -> None:
    """The folder's index as checkpoints were written before shard entries said where their
    bytes start: a load then finds each shard through its file's safetensors header."""
    edit_index(folder, lambda h, p: [s.pop("start") for part in p.values() for shards in part["tensors"].values()
                                     for s in shards])


def shards_of(parts: dict, rank: int = 1):
    """The shards rank `rank` saved (all in its file)."""
    return [s for shards in parts[rank]["tensors"].values() for s in shards]


def falls_back(root: Path, match: str) -> None:
    """Step 2 is refused with `match`, nothing outside `root` is opened, step 1 loads intact."""
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    with confine_opens(root) as escapes:
        for rank in (None, 1):              # all parts; rank 1's first (Index.exact_shard)
            with pytest.raises(CheckpointError, match=match):
                Checkpoint(root / STEP2, rank=rank).read_pieces(pieces)
        used, arrays = load_with_fallback(candidates(root), lambda c: c.read_pieces(pieces))
    assert escapes == []
    assert used.step == 1
    ref = reference()
    assert all(np.array_equal(arrays[n], cut(ref[n], p.region)) for n, p in pieces.items())


# ---- paths ---------------------------------------------------------------------------------
def outside_copy(root: Path) -> Path:
    """A byte-exact copy of a real shard outside the checkpoint (its checksums match)."""
    evil = root.parent.parent / "outside" / "evil.safetensors"
    evil.parent.mkdir()
    shutil.copy(root / STEP2 / "rank_00001.safetensors", evil)
    return evil


@pytest.mark.parametrize("kind", ["relative", "absolute", "etc_passwd"])
def test_shard_file_outside_the_folder_is_refused_unopened(root, kind):
    evil = outside_copy(root)
    name = {"relative": os.path.relpath(evil, root / STEP2), "absolute": str(evil), "etc_passwd": "/etc/passwd"}[kind]
    edit_index(root / STEP2, lambda h, p: [s.update(file=name) for s in shards_of(p)])
    falls_back(root, r"shard 'file' of tensor '.*' is '.*', which points outside the folder")


def test_symlinked_shard_leading_outside_is_refused(root):
    evil = outside_copy(root)
    (root / STEP2 / "rank_00001.safetensors").unlink()
    (root / STEP2 / "rank_00001.safetensors").symlink_to(evil)
    falls_back(root, "a symbolic link to .*evil.safetensors outside the folder")


def test_convert_to_hf_refuses_an_escaping_shard_in_one_line(root, tmp_path, capsys):
    evil = outside_copy(root)
    edit_index(root / STEP2, lambda h, p: [s.update(file=os.path.relpath(evil, root / STEP2)) for s in shards_of(p)])
    with confine_opens(root, tmp_path / "hf") as escapes:
        rc = main(["convert-checkpoint", str(root), str(tmp_path / "hf"), "--to", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "points outside the folder" in err[0] and escapes == []


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_latest_pointer_outside_the_root_is_refused(root, kind):
    other = root.parent.parent / "other_run" / "checkpoints" / "step_00000030"
    shutil.copytree(root / STEP2, other)
    name = "../../other_run/checkpoints/step_00000030" if kind == "relative" else str(other)
    (root / "latest").write_text(name)
    with confine_opens(root) as escapes:
        for load in (Checkpoint.open, candidates):
            with pytest.raises(CheckpointError, match=r"'latest' .* is '.*step_00000030', which points outside"):
                load(root)
    assert escapes == []


def test_latest_naming_a_missing_folder_is_a_warning(root, caplog):
    (root / "latest").write_text("step_00000099")
    with caplog.at_level(logging.WARNING, logger="ms_llm.checkpoint"):
        assert Checkpoint.open(root).step == 2
        assert [p.name for p in candidates(root)] == [STEP2, "step_00000001"]
    warned = [r.getMessage() for r in caplog.records if "step_00000099" in r.getMessage()]
    assert len(warned) == 2 and "not a committed checkpoint folder" in warned[0] and STEP2 in warned[0]


def test_writes_do_not_follow_symlinks_out_of_the_folder(root, tmp_path):
    outside = tmp_path / "outside_dir"
    outside.mkdir()
    (root / "step_00000003.tmp").symlink_to(outside, target_is_directory=True)
    w = CheckpointWriter(root, 1, 2, session="s3")
    w.save(3, [SaveItem(p, cut(reference()[n], p.region)) for n, p in rank_pieces(PLAN, 1).items()])
    with pytest.raises(CheckpointError, match="a shard file is 'step_00000003.tmp/rank_00001.safetensors', a symbolic"):
        w.close()
    assert list(outside.iterdir()) == []
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to(target)
    with pytest.raises(CheckpointError, match="an export file is 'model.safetensors', a symbolic link"):
        export_hf(root, tmp_path / "hf")
    assert target.read_text() == "keep me"


# ---- numbers in index.json and its parts ---------------------------------------------------
def first_shard(p: dict) -> dict:
    return shards_of(p)[0]


def norm(h: dict) -> dict:
    return h["tensors"]["model.norm.weight"]


def lm_head(h: dict) -> dict:
    """Split over both ranks: a load reads its head entry's `parts` (and `split`) to find its shards."""
    return h["tensors"]["lm_head.weight"]


NORM = "model.norm.weight"                   # replicated under tp: rank 0 saved it, in part 0
INDEX_CASES = {
    "block 0": (lambda h, p: first_shard(p).update(block=0), r"index_00001.json: tensor '.*' shard \d: 'block' is 0"),
    "block text": (lambda h, p: first_shard(p).update(block="4096"), r"'block' is '4096'; expected an integer"),
    "crc text": (lambda h, p: first_shard(p).update(crc32c=["x"]), r"'crc32c\[0\]' is 'x'"),
    "crc count": (lambda h, p: first_shard(p).update(crc32c=[0, 0, 0]), "3 checksums for"),
    "crc both": (lambda h, p: first_shard(p).update(crc32=[0]), "checksums under both .crc32c. and .crc32."),
    "crc none": (lambda h, p: first_shard(p).pop("crc32c"), r"'crc32c' is None; expected a list"),
    "shape text": (lambda h, p: norm(h).update(shape="abc"), r"tensor 'model.norm.weight': 'shape' is 'abc'"),
    "shape float": (lambda h, p: norm(h).update(shape=[64.0]), r"'shape\[0\]' is 64.0"),
    "shape huge": (lambda h, p: norm(h).update(shape=[10 ** 12]), r"'model.norm.weight' is \(1000000000000,\) in "
                                                                 r"the checkpoint but \(64,\) in the model loading it"),
    "shard missing": (lambda h, p: p[1]["tensors"]["lm_head.weight"].pop(),
                      "'lm_head.weight': the saved shards hold 4096 of the 8192 wanted elements"),
    "shape and shard huge": (lambda h, p: (norm(h).update(shape=[10 ** 12]), p[0]["tensors"][NORM][0].update(
        sizes=[10 ** 12], block=4 * 10 ** 12, crc32c=[0])), r"'model.norm.weight' is \(1000000000000,\) in the "
                                                           r"checkpoint but \(64,\) in the model loading it"),
    "start text": (lambda h, p: first_shard(p).update(start="64"), r"'start' is '64'; expected an integer in \[8, "),
    "start in the header length": (lambda h, p: first_shard(p).update(start=0), r"'start' is 0; expected an integer"),
    "start past the end": (lambda h, p: first_shard(p).update(start=10 ** 9), r"rank_00001.safetensors: truncated: "
                                                                              r"tensor '.*' needs bytes up to \d+ but "
                                                                              r"the file has \d+"),
    "start shifted": (lambda h, p: first_shard(p).update(start=first_shard(p)["start"] + 4),
                      r"rank_00001.safetensors: tensor '.*' \(key '.*'\) fails its checksum"),
    "offset negative": (lambda h, p: first_shard(p).update(offsets=[-1, 0]), r"'offsets\[0\]' is -1"),
    "offset past end": (lambda h, p: first_shard(p).update(offsets=[10 ** 6, 0]), "outside the tensor's"),
    "flat reversed": (lambda h, p: first_shard(p).update(flat=[5, 2]), "'flat' is"),
    "dtype": (lambda h, p: norm(h).update(dtype="float128"), "'dtype' is 'float128'"),
    "step": (lambda h, p: h.update(step="x"), "'step' is 'x'"),
    "world size": (lambda h, p: h.update(world_size=0), "'world_size' is 0"),
    "rank key": (lambda h, p: h["rank_states"].update(abc={}), "'rank_states' key 'abc'"),
    "bytes": (lambda h, p: h["state"].update(rng={"__bytes__": 5}), "'state': a stored byte string does not decode"),
    "tensors list": (lambda h, p: h.update(tensors=[]), "'tensors': expected a JSON object"),
    "shards dict": (lambda h, p: p[0]["tensors"].update({NORM: {}}), "tensor 'model.norm.weight': expected a list"),
    "file number": (lambda h, p: first_shard(p).update(file=7), "'file' and 'key' must be strings"),
    "version": (lambda h, p: h.update(version=3), "format version 3 but this ms_llm reads versions 1, 2"),
    "parts missing": (lambda h, p: h["parts"].pop(), r"'parts' must list one record per rank \(2\)"),
    "also outside": (lambda h, p: h["parts"][1].update(also=[2]), r"'parts'\[1\]: 'also\[0\]' is 2; expected an "
                                                                  r"integer in \[0, 1\]"),
    "part of a stranger": (lambda h, p: p[1]["tensors"].update(evil=[]), "has shards of tensor 'evil', which"),
    "part of another rank": (lambda h, p: p[1].update(rank=0), "index_00001.json: not the index part of rank 1"),
    "part of another step": (lambda h, p: p[1].update(step=1), "not the index part of rank 1 at step 2"),
    "holders not a list": (lambda h, p: lm_head(h).update(parts="all"), r"tensor 'lm_head.weight': 'parts' must be "
                                                                        r"a non-empty list of \[start, stop\) rank runs"),
    "holders outside": (lambda h, p: lm_head(h).update(parts=[[0, 3]]), r"'parts\[1\]' is 3; expected an integer in "
                                                                        r"\[0, 2\]"),
    "holders run empty": (lambda h, p: lm_head(h).update(parts=[[1, 1]]), r"'parts' run \[1, 1\] is empty or not "
                                                                          r"after"),
    "holders leave a rank out": (lambda h, p: h["tensors"]["lm_head.weight"].update(parts=[[0, 1]], split=None),
                                 "'lm_head.weight': the saved shards hold 4096 of the 8192 wanted elements"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index_numbers_are_checkpoint_errors_and_fall_back(root, case):
    edit, match = INDEX_CASES[case]
    edit_index(root / STEP2, edit)
    falls_back(root, match)


SPLIT_CASES = {                             # lm_head.weight's split, and what the refusal says
    "text": ("rows", r"'lm_head.weight': 'split' is 'rows'; expected a list of \[dim, size, digits\]"),
    "entry": ([[0, 64]], r"'split' entry \[0, 64\] is not \[dim, size, \[\[stride, count\], ...\]\]"),
    "dim outside": ([[2, 64, [[1, 2]]]], r"'split' \[\[2, 64, \[\[1, 2\]\]\]\] does not number 2 savers over "
                                         r"distinct dimensions in \[-1, 1\]"),
    "dim twice": ([[0, 64, [[1, 2]]], [0, 32, [[1, 1]]]], "does not number 2 savers"),
    "dim negative": ([[-2, 64, [[1, 2]]]], r"'split\[0\]' is -2; expected an integer in \[-1, "),
    "size 0": ([[0, 0, [[1, 2]]]], "does not number 2 savers"),
    "digits past the savers": ([[0, 64, [[2, 2]]]], "does not number 2 savers"),
    "count huge": ([[0, 64, [[1, 10 ** 9]]]], r"'split digits\[1\]' is 1000000000; expected an integer in \[1, 2\]"),
    "float": ([[0, 64.0, [[1, 2]]]], r"'split\[1\]' is 64.0"),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_a_bad_split_is_refused_where_a_reshard_reads_it(root, case):
    """A tensor's `split` is parsed when a reshard first narrows the parts it reads by it (a
    same-layout load never does); a malformed one is a CheckpointError naming the field, and the
    load falls back to step 1 without opening anything outside the folder."""
    split, match = SPLIT_CASES[case]
    edit_index(root / STEP2, lambda h, p: h["tensors"]["lm_head.weight"].update(split=split))
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    with confine_opens(root) as escapes:
        with pytest.raises(CheckpointError, match=match):
            Checkpoint(root / STEP2, rank=1).read_pieces(pieces)
        used, arrays = load_with_fallback(candidates(root), lambda c: c.read_pieces(pieces), rank=1)
    assert escapes == [] and used.step == 1
    assert np.array_equal(arrays["lm_head.weight"], reference()["lm_head.weight"])


@pytest.mark.parametrize("split", [[[0, 128, [[1, 2]]]], [[1, 64, [[1, 2]]]], [[-1, 10 ** 15, [[1, 2]]]]])
def test_a_split_that_misleads_the_reshard_is_refused_and_falls_back(root, split):
    """A `split` that does not say how the savers hold the tensor leads a reshard to parts that
    do not hold all it wants: the read counts what it found and refuses, naming the tensor."""
    edit_index(root / STEP2, lambda h, p: h["tensors"]["lm_head.weight"].update(split=split))
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    with confine_opens(root) as escapes:
        with pytest.raises(CheckpointError, match=r"'lm_head.weight': the saved shards hold \d+ of the 8192 wanted"):
            Checkpoint(root / STEP2, rank=1).read_pieces(pieces)
        used, arrays = load_with_fallback(candidates(root), lambda c: c.read_pieces(pieces), rank=1)
    assert escapes == [] and used.step == 1
    assert np.array_equal(arrays["lm_head.weight"], reference()["lm_head.weight"])


def test_huge_shape_is_refused_before_allocating_the_full_tensor(root):
    """convert-checkpoint reads whole tensors (read_full); an index claiming 10**12 elements
    used to allocate 3.64 TiB before looking at the files."""
    edit_index(root / STEP2, INDEX_CASES["shape and shard huge"][0])
    with pytest.raises(CheckpointError, match="truncated: tensor 'model.norm.weight' needs bytes up to 4000000"):
        Checkpoint(root / STEP2).read_full("model.norm.weight")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "from step 1", "missing"])
def test_a_damaged_or_foreign_index_part_is_refused_and_falls_back(root, damage):
    part = root / STEP2 / "index_00001.json"
    data = part.read_bytes()
    if damage == "flipped":
        part.write_bytes(data.replace(b'"block":', b'"block" :', 1)[:len(data)])
    elif damage == "truncated":
        part.write_bytes(data[:-1])
    elif damage == "from step 1":
        shutil.copy(root / "step_00000001" / part.name, part)
    else:
        part.unlink()
    falls_back(root, r"index_00001.json: (missing; .* names 2 index parts|\d+ bytes that do not match the size "
                     r"\(\d+\) and crc32c .* records; the part is damaged or from another save)")


# ---- numbers in safetensors headers ------------------------------------------------------------
def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


HEADER_CASES = {
    "negative offsets": (lambda h: first_tensor(h).update(data_offsets=[-2 ** 40, -2 ** 40 + 4]),
                         r"rank_00001.safetensors: tensor '.*': 'data_offsets\[0\]' is -1099511627776"),
    "shape text": (lambda h: first_tensor(h).update(shape="abc"), r"tensor '.*': 'shape' is 'abc'"),
    "shape huge": (lambda h: first_tensor(h).update(shape=[10 ** 12], data_offsets=[0, 4 * 10 ** 12]),
                   "truncated: needs bytes up to"),
    "offsets mismatch": (lambda h: first_tensor(h).update(data_offsets=[0, 3]), "hold 3 bytes but shape"),
    "dtype": (lambda h: first_tensor(h).update(dtype="Q8"), "header entry is malformed"),
    "not an object": (lambda h: [1, 2], "header is a list, not a JSON object"),
    "metadata": (lambda h: h.update(__metadata__=[1]), "'__metadata__' is not a JSON object"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_bad_header_numbers_are_checkpoint_errors_and_fall_back(root, case):
    """Where the index does not say where a shard starts, the load reads the header and checks it."""
    without_starts(root / STEP2)
    edit, match = HEADER_CASES[case]
    edit_header(root / STEP2 / "rank_00001.safetensors", edit)
    falls_back(root, match)


def test_a_load_reads_where_the_index_says_and_verify_holds_the_header_to_it(root):
    """A shard's bytes are read from the `start` its index entry gives, under its checksums, so a
    damaged safetensors header with the tensors' bytes intact loads exactly; verify names it."""
    edit_header(root / STEP2 / "rank_00001.safetensors", lambda h: first_tensor(h).update(dtype="Q8"), in_place=True)
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    ref = reference()
    with confine_opens(root) as escapes:
        arrays = Checkpoint(root / STEP2, rank=1).read_pieces(pieces)
        with pytest.raises(CheckpointError, match=r"rank_00001.safetensors: tensor '.*': header entry is malformed"):
            Checkpoint(root / STEP2).verify()
    assert escapes == []
    assert all(np.array_equal(arrays[n], cut(ref[n] + 1, p.region)) for n, p in pieces.items())


def test_verify_holds_each_start_to_the_files_header(root):
    edit_index(root / STEP2, INDEX_CASES["start shifted"][0])
    with pytest.raises(CheckpointError, match=r"rank_00001.safetensors: tensor '.*' starts at byte \d+ in the "
                                              r"file's header but at \d+ in the index"):
        Checkpoint(root / STEP2).verify()


def test_header_length_and_non_regular_files(root):
    path = root / STEP2 / "rank_00001.safetensors"
    raw = path.read_bytes()
    without_starts(root / STEP2)
    path.write_bytes(struct.pack("<Q", 2 ** 63) + raw[8:])
    falls_back(root, "header length 9223372036854775808 does not fit the file")
    path.unlink()
    os.mkfifo(path)                      # would block a plain open() forever
    falls_back(root, "rank_00001.safetensors: not a regular file")


# ---- imported folders --------------------------------------------------------------------------
def hf_folder(root: Path, tmp_path: Path) -> Path:
    out = tmp_path / "hf"
    export_hf(root / "step_00000001", out, max_shard_bytes=100_000)
    return out


def test_hf_weight_map_outside_the_folder_is_refused(root, tmp_path):
    out = hf_folder(root, tmp_path)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../" + index["weight_map"][key]
    shutil.copy(out / index["weight_map"][key][3:], tmp_path)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with confine_opens(out) as escapes, pytest.raises(CheckpointError, match="'weight_map' is '../model-"):
        hf_source(out)
    assert escapes == []


@pytest.mark.parametrize("field,value,match", [("num_hidden_layers", 1e308, r"model.num_layers: got 1e\+308"),
                                               ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")},
                                                "model.rope_theta: got nan"),
                                               ("num_key_value_heads", 0, "model.num_kv_heads: got 0")])
def test_hf_config_numbers_go_through_the_schema(root, tmp_path, field, value, match):
    out = hf_folder(root, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=rf"config.json: {match}"):
        hf_source(out)


def test_dcp_storage_outside_the_folder_and_oversized_tensors_are_refused(root, tmp_path):
    import pickle

    import torch
    from torch_backend.dcp import export_dcp, import_dcp

    from ckpt_helpers import TINY
    out = export_dcp(root / "step_00000001", tmp_path / "dcp")
    meta = pickle.loads((out / ".metadata").read_bytes())
    good = (out / ".metadata").read_bytes()
    for info in meta.storage_data.values():
        info.relative_path = "../" + info.relative_path
    (out / ".metadata").write_bytes(pickle.dumps(meta))
    with confine_opens(out) as escapes, pytest.raises(CheckpointError, match=r"storage file of .* is '../"):
        import_dcp(out, tmp_path / "imported", TINY)
    assert escapes == []
    meta = pickle.loads(good)
    name = next(iter(meta.state_dict_metadata))
    meta.state_dict_metadata[name].size = torch.Size([10 ** 12])
    (out / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' of size \[1000000000000\] needs"):
        import_dcp(out, tmp_path / "imported", TINY)


@pytest.mark.mindspore
def test_mindspore_rank_checkpoint_symlinked_outside_is_refused(tmp_path):
    pytest.importorskip("mindspore")
    from ms_llm.mindspore.checkpoint import rank_checkpoint
    (tmp_path / "ms" / "rank_0").mkdir(parents=True)
    (tmp_path / "evil.ckpt").write_bytes(b"x")
    (tmp_path / "ms" / "rank_0" / "checkpoint_0.ckpt").symlink_to(tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="the checkpoint of rank 0 is 'rank_0/checkpoint_0.ckpt', a symbolic"):
        rank_checkpoint(tmp_path / "ms", 0)


def test_convert_into_an_unwritable_folder_is_one_line(root, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    rc = main(["convert-checkpoint", str(root), str(tmp_path / "file" / "hf"), "--to", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "file/hf" in err[0] and "Not a directory" in err[0]
