"""Megatron's indexed format: our writer and reader, megatron-core both ways, and every bad file."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ms_llm.data.gpt import GPTSamples, build_indices
from ms_llm.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from ms_llm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
GPT = {"seed": 11, "seq_len": 16, "samples": 50, "split": "969,30,1"}


def documents(n: int = 30, high: int = 1000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(k)) for k in rng.integers(0, 60, n)]   # some empty


def write(prefix: Path, docs, dtype=np.uint16) -> Path:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def test_round_trip_and_megatrons_dtype_rule(tmp_path):
    assert dtype_for_vocab(65499) == np.uint16 and dtype_for_vocab(65500) == np.int32
    for dtype in (np.uint16, np.int32):
        docs = documents(high=70000 if dtype == np.int32 else 1000)
        ds = IndexedDataset(write(tmp_path / np.dtype(dtype).name, docs, dtype))
        assert len(ds) == len(docs) and ds.dtype == dtype and ds.sizes.dtype == np.int32
        assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
        assert list(ds.sizes) == [len(d) for d in docs]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int32.bin", "int32.idx", "uint16.bin", "uint16.idx"]


def test_a_failed_write_leaves_nothing_under_a_final_name(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document(np.arange(5))
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="do not fit uint16; write with int32"):
        IndexedDatasetWriter(tmp_path / "e", np.uint16).add_document(np.array([70000]))


def test_megatron_core_reads_ours_and_we_read_its_files_and_its_gpt_indices(tmp_path):
    """One megatron-core subprocess: it reads what we wrote, writes its own files (one and two
    sequences per document), and builds its GPTDataset indices over our file, which ours equal."""
    if not (ORACLES / "megatron").is_dir():
        pytest.fail(".oracles/ has no megatron-core: run `make oracles`")
    docs = documents()
    ours = write(tmp_path / "ours", docs)
    args = {"ours": str(ours), "out": str(tmp_path), "gpt": GPT}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "megatron_data_probe.py"), json.dumps(args)],
                          env={**os.environ, "PYTHONPATH": str(ORACLES)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert result["ours"]["dtype"] == "uint16"
    assert result["ours"]["documents"] == [d.tolist() for d in docs]
    assert result["ours"]["document_indices"] == list(range(len(docs) + 1))

    written = result["written"]
    mine = write(tmp_path / "mine_u16", [np.array(d) for d in written])
    for suffix in (".bin", ".idx"):                                   # byte for byte
        assert (tmp_path / f"meg_u16{suffix}").read_bytes() == Path(f"{mine}{suffix}").read_bytes()
    theirs = IndexedDataset(tmp_path / "meg_i32")                     # several sequences per document
    assert theirs.dtype == np.int32 and len(theirs) == len(written)
    assert [theirs[i].tolist() for i in range(len(theirs))] == written
    assert theirs.document_indices.tolist() == list(range(0, len(written) + 1, 2))

    ds = IndexedDataset(ours)
    assert result["train_documents"] == [0, 29] and result["valid_documents"] == [29, 30]
    ix = build_indices(ds.sizes, np.arange(0, 29), GPT["seq_len"], GPT["samples"], GPT["seed"])
    for name in ("document", "sample", "shuffle"):
        assert np.array_equal(getattr(ix, name), np.load(tmp_path / f"gpt_{name}.npy")), name
    assert GPTSamples(ds, ix, GPT["seq_len"]).sample(3).tolist() == result["train_sample_3"]


@pytest.fixture
def good(tmp_path) -> Path:
    return write(tmp_path / "good", documents())


def test_missing_files(good):
    os.remove(f"{good}.bin")
    with pytest.raises(ConfigError, match=r"good\.bin does not exist"):
        IndexedDataset(good)
    os.remove(f"{good}.idx")
    with pytest.raises(ConfigError, match=r"good\.idx does not exist"):
        IndexedDataset(good)


@pytest.mark.parametrize("offset,data,message", [
    (0, b"NOTANIDX!", "not a Megatron .idx file"),
    (9, struct.pack("<Q", 2), "format version 2"),
    (17, struct.pack("<B", 99), "unknown dtype code 99"),
])
def test_bad_header(good, offset, data, message):
    raw = bytearray(Path(f"{good}.idx").read_bytes())
    raw[offset:offset + len(data)] = data
    Path(f"{good}.idx").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=message):
        IndexedDataset(good)


def test_an_idx_that_does_not_match_its_bin(good, tmp_path):
    other = write(tmp_path / "other", documents(seed=1))
    os.replace(f"{other}.bin", f"{good}.bin")
    with pytest.raises(ConfigError, match=r"good\.idx describes \d+ bytes .* does not match its \.bin"):
        IndexedDataset(good)
    Path(f"{good}.idx").write_bytes(Path(f"{good}.idx").read_bytes()[:-8])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        IndexedDataset(good)
