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

import numpy as np
import pytest

from ckpt_guard import confine_opens
from ckpt_helpers import cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, candidates, load_with_fallback, run_config
from ms_llm.checkpoint.hf import export_hf, hf_source
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
    path = folder / "index.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = edit(header) or header
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def shards_of(data: dict, file: str = "rank_00001.safetensors"):
    return [s for t in data["tensors"].values() for s in t["shards"] if s["file"] == file]


def falls_back(root: Path, match: str) -> None:
    """Step 2 is refused with `match`, nothing outside `root` is opened, step 1 loads intact."""
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1)
    with confine_opens(root) as escapes:
        with pytest.raises(CheckpointError, match=match):
            Checkpoint(root / STEP2).read_pieces(pieces)
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
    edit_index(root / STEP2, lambda d: [s.update(file=name) for s in shards_of(d)])
    falls_back(root, r"shard 'file' of tensor '.*' is '.*', which points outside the folder")


def test_symlinked_shard_leading_outside_is_refused(root):
    evil = outside_copy(root)
    (root / STEP2 / "rank_00001.safetensors").unlink()
    (root / STEP2 / "rank_00001.safetensors").symlink_to(evil)
    falls_back(root, "a symbolic link to .*evil.safetensors outside the folder")


def test_convert_to_hf_refuses_an_escaping_shard_in_one_line(root, tmp_path, capsys):
    evil = outside_copy(root)
    edit_index(root / STEP2, lambda d: [s.update(file=os.path.relpath(evil, root / STEP2)) for s in shards_of(d)])
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


# ---- numbers in index.json ---------------------------------------------------------------------
def first_shard(d: dict) -> dict:
    return shards_of(d)[0]


def norm(d: dict) -> dict:
    return d["tensors"]["model.norm.weight"]


INDEX_CASES = {
    "block 0": (lambda d: first_shard(d).update(block=0), r"index.json: tensor '.*' shard \d: 'block' is 0"),
    "block text": (lambda d: first_shard(d).update(block="4096"), r"'block' is '4096'; expected an integer"),
    "crc text": (lambda d: first_shard(d).update(crc32c=["x"]), r"'crc32c\[0\]' is 'x'"),
    "crc count": (lambda d: first_shard(d).update(crc32c=[0, 0, 0]), "3 checksums for"),
    "crc both": (lambda d: first_shard(d).update(crc32=[0]), "checksums under both .crc32c. and .crc32."),
    "crc none": (lambda d: first_shard(d).pop("crc32c"), r"'crc32c' is None; expected a list"),
    "shape text": (lambda d: norm(d).update(shape="abc"), r"tensor 'model.norm.weight': 'shape' is 'abc'"),
    "shape float": (lambda d: norm(d).update(shape=[64.0]), r"'shape\[0\]' is 64.0"),
    "shape huge": (lambda d: norm(d).update(shape=[10 ** 12]), r"'model.norm.weight' is \(1000000000000,\) in the "
                                                             r"checkpoint but \(64,\) in the model loading it"),
    "shard missing": (lambda d: d["tensors"]["lm_head.weight"]["shards"].pop(),
                      "'lm_head.weight': the saved shards hold 4096 of the 8192 wanted elements"),
    "shape and shard huge": (lambda d: (norm(d).update(shape=[10 ** 12]), norm(d)["shards"][0].update(
        sizes=[10 ** 12], block=4 * 10 ** 12, crc32c=[0])), r"'model.norm.weight' is \(1000000000000,\) in the "
                                                           r"checkpoint but \(64,\) in the model loading it"),
    "offset negative": (lambda d: first_shard(d).update(offsets=[-1, 0]), r"'offsets\[0\]' is -1"),
    "offset past end": (lambda d: first_shard(d).update(offsets=[10 ** 6, 0]), "outside the tensor's"),
    "flat reversed": (lambda d: first_shard(d).update(flat=[5, 2]), "'flat' is"),
    "dtype": (lambda d: norm(d).update(dtype="float128"), "'dtype' is 'float128'"),
    "step": (lambda d: d.update(step="x"), "'step' is 'x'"),
    "world size": (lambda d: d.update(world_size=0), "'world_size' is 0"),
    "rank key": (lambda d: d["rank_states"].update(abc={}), "'rank_states' key 'abc'"),
    "bytes": (lambda d: d["state"].update(rng={"__bytes__": 5}), "'state': a stored byte string does not decode"),
    "tensors list": (lambda d: d.update(tensors=[]), "'tensors': expected a JSON object"),
    "shards dict": (lambda d: norm(d).update(shards={}), "'shards' a list"),
    "file number": (lambda d: first_shard(d).update(file=7), "'file' and 'key' must be strings"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index_numbers_are_checkpoint_errors_and_fall_back(root, case):
    edit, match = INDEX_CASES[case]
    edit_index(root / STEP2, edit)
    falls_back(root, match)


def test_huge_shape_is_refused_before_allocating_the_full_tensor(root):
    """convert-checkpoint reads whole tensors (read_full); an index claiming 10**12 elements
    used to allocate 3.64 TiB before looking at the files."""
    edit_index(root / STEP2, INDEX_CASES["shape and shard huge"][0])
    with pytest.raises(CheckpointError, match="in the file but"):
        Checkpoint(root / STEP2).read_full("model.norm.weight")


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
    edit, match = HEADER_CASES[case]
    edit_header(root / STEP2 / "rank_00001.safetensors", edit)
    falls_back(root, match)


def test_header_length_and_non_regular_files(root):
    path = root / STEP2 / "rank_00001.safetensors"
    raw = path.read_bytes()
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
    from torch_backend.checkpoint import export_dcp, import_dcp

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
