"""`ms-llm prepare-data`: text in, Megatron indexed dataset + tokenizer + summary out.

Round trips (every document decodes back to its text, then EOS), each tokenizer against its own
library, --workers N byte-identical to one, every bad input a one-line error with exit status 2
and nothing left under a final name, and the MindRecord import against a file MindSpore writes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ms_llm.cli import main
from ms_llm.data import readers
from ms_llm.data.indexed import IndexedDataset

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln — naïve café, 東京, emoji 🦙 and tabs\tand CRLF\r\nline\r\n",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "   leading spaces, trailing newline\n\n",
]
JSONL_TEXTS = ["first JSON document", "second one with a\nnewline and \"quotes\"", "ünïcödé 🦙"]


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        (folder / ("sub" if i % 2 else ".") / f"doc{i}.txt").write_bytes(text.encode())
    (folder / ".hidden.txt").write_text("never read")
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(JSONL_TEXTS)) + "\n")
    return folder, jsonl


def folder_order() -> list[str]:
    """Sorted walk: doc0, doc2 at the top, then sub/doc1, sub/doc3."""
    return [TEXTS[0], TEXTS[2], TEXTS[1], TEXTS[3]]


def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ms_llm", "prepare-data", *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def docs(prefix: Path) -> list[np.ndarray]:
    ds = IndexedDataset(str(prefix))
    return [np.asarray(ds[i]) for i in range(len(ds))]


def test_trained_bpe_round_trips_a_folder_and_jsonl(tmp_path):
    from tokenizers import Tokenizer

    folder, jsonl = write_inputs(tmp_path)
    out = cli("--input", str(folder), str(jsonl), "--train-tokenizer", "bpe", "--vocab-size", "512",
              "--output", str(tmp_path / "out" / "ds"))
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary == json.loads((tmp_path / "out" / "ds.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = folder_order() + JSONL_TEXTS
    rows = docs(tmp_path / "out" / "ds")
    assert [tok.decode(r[:-1].tolist(), skip_special_tokens=False) for r in rows] == expected
    assert all(r[-1] == eos for r in rows) and rows[0].dtype == np.uint16
    assert summary["documents"] == len(expected) and summary["tokens"] == sum(map(len, rows))
    assert summary["tokenizer"]["path"] == str((tmp_path / "out" / "tokenizer.json").resolve())
    # BPE stops merging when no pair is left: a small input gives fewer than 512 ids
    assert summary["vocab_size"] == tok.get_vocab_size() <= 512 and summary["eos_id"] == eos
    assert summary["max_token_id"] == max(int(r.max()) for r in rows) < summary["vocab_size"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds.bin", "ds.idx", "ds.json", "tokenizer.json"]


def test_sentencepiece_model_encodes_as_sentencepiece(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 20 + JSONL_TEXTS * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", character_coverage=0.99, byte_fallback=True,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    _, jsonl = write_inputs(tmp_path)
    assert main(["prepare-data", "-i", str(jsonl), "--tokenizer", str(tmp_path / "sp.model"),
                 "-o", str(tmp_path / "sp_ds")]) == 0
    assert [r.tolist() for r in docs(tmp_path / "sp_ds")] == [sp.encode(t) + [sp.eos_id()] for t in JSONL_TEXTS]


def test_byte_tokenizer_and_no_eod(tmp_path, capsys):
    folder, _ = write_inputs(tmp_path)
    assert main(["prepare-data", "-i", str(folder), "--tokenizer", "bytes", "-o", str(tmp_path / "b")]) == 0
    assert [bytes(r[:-1].astype(np.uint8)).decode() for r in docs(tmp_path / "b")] == folder_order()
    assert all(r[-1] == 257 for r in docs(tmp_path / "b"))
    assert main(["prepare-data", "-i", str(folder), "--tokenizer", "bytes", "--no-append-eod",
                 "-o", str(tmp_path / "b2")]) == 0
    assert [bytes(r.astype(np.uint8)).decode() for r in docs(tmp_path / "b2")] == folder_order()


def test_preparation_modules_import_no_tokenizer_library():
    """The libraries load when a tokenizer or an input format needs them, not on import."""
    libs = ("tokenizers", "sentencepiece", "pyarrow", "datasets", "mindspore", "torch")
    code = ("import sys, ms_llm.data.prepare, ms_llm.data.readers, ms_llm.data.tokenizers, "
            f"ms_llm.commands.prepare_data; print(sorted(m for m in {libs!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_workers_write_byte_identical_files(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "BATCH_DOCS", 3)     # many batches, so order across workers matters
    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 7)}) + "\n"
                           for i in range(40)))
    for workers in ("1", "2"):
        assert main(["prepare-data", "-i", str(src), "--train-tokenizer", "bpe", "--vocab-size", "300",
                     "--workers", workers, "-o", str(tmp_path / f"w{workers}" / "ds")]) == 0
    for name in ("ds.bin", "ds.idx", "tokenizer.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    assert len(docs(tmp_path / "w2" / "ds")) == 40


def test_tokenizer_json_given_by_path(tmp_path):
    _, jsonl = write_inputs(tmp_path)
    assert main(["prepare-data", "-i", str(jsonl), "--train-tokenizer", "bpe", "--vocab-size", "300",
                 "-o", str(tmp_path / "a" / "ds")]) == 0
    assert main(["prepare-data", "-i", str(jsonl), "--tokenizer", str(tmp_path / "a"),
                 "-o", str(tmp_path / "b" / "ds")]) == 0
    assert (tmp_path / "a" / "ds.bin").read_bytes() == (tmp_path / "b" / "ds.bin").read_bytes()
    assert not (tmp_path / "b" / "tokenizer.json").exists()   # recorded in the summary, not copied
    summary = json.loads((tmp_path / "b" / "ds.json").read_text())
    assert summary["tokenizer"]["path"] == str((tmp_path / "a" / "tokenizer.json").resolve())


def test_empty_documents_are_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "e.jsonl"
    src.write_text('{"text": "kept"}\n{"text": ""}\n\n{"text": "  \\n "}\n{"text": "also kept"}\n')
    assert main(["prepare-data", "-i", str(src), "--tokenizer", "bytes", "-o", str(tmp_path / "e")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 2 and summary["skipped"] == {"empty": 2, "invalid_utf8": 0}


def test_invalid_utf8_can_be_skipped(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("fine")
    (tmp_path / "in" / "b.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "in" / "c.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert main(["prepare-data", "-i", str(tmp_path / "in"), "--tokenizer", "bytes", "--skip-invalid-utf8",
                 "-o", str(tmp_path / "u")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 2 and summary["skipped"]["invalid_utf8"] == 2


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(arguments, what the one-line error must say) per bad input."""
    good = "".join(json.dumps({"text": f"good document {i}"}) + "\n" for i in range(3000))
    (tmp_path / "latin1.txt").write_bytes("line one\ncafé\n".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + '{"text": "café"}\n'.encode("latin-1"))
    (tmp_path / "nokey.jsonl").write_text(good + '{"content": "x", "id": 1}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "caf\\u00e9"}\n{"text": "half \\ud83e a llama"}\n')
    (tmp_path / "exists.bin").write_bytes(b"")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    tok = ["--tokenizer", "bytes"]
    return [
        (["-i", str(tmp_path / "latin1.txt"), *tok], f"{tmp_path / 'latin1.txt'}:2: not UTF-8 (byte 0xe9 at column 4)"),
        (["-i", str(tmp_path / "latin1.jsonl"), *tok], f"{tmp_path / 'latin1.jsonl'}:3001: not UTF-8"),
        (["-i", str(tmp_path / "latin1.jsonl"), "--train-tokenizer", "bpe", "--vocab-size", "300"],
         f"{tmp_path / 'latin1.jsonl'}:3001: not UTF-8"),
        (["-i", str(tmp_path / "nokey.jsonl"), *tok], f"{tmp_path / 'nokey.jsonl'}:3001: no 'text' key (keys: "
                                                      f"content, id); pass --text-key"),
        (["-i", str(tmp_path / "notjson.jsonl"), *tok], f"{tmp_path / 'notjson.jsonl'}:2: not a JSON object"),
        (["-i", str(tmp_path / "surrogate.jsonl"), *tok], f"{tmp_path / 'surrogate.jsonl'}:2: 'text' holds a lone"),
        (["-i", str(tmp_path / "missing.txt"), *tok], f"--input: {tmp_path / 'missing.txt'} does not exist"),
        (["-i", str(tmp_path / "latin1.txt")], "--tokenizer / --train-tokenizer: give exactly one"),
        (["-i", str(tmp_path / "latin1.txt"), "--tokenizer", str(tmp_path / "nope.json")], "does not exist"),
        (["-i", str(tmp_path / "latin1.txt"), "--train-tokenizer", "bpe", "--vocab-size", "100"],
         "--vocab-size: 100 is too small"),
    ]


def test_bad_input_is_one_line_and_exit_2_with_nothing_left(tmp_path, capsys):
    for args, message in bad_inputs(tmp_path):
        before = sorted(p.name for p in tmp_path.iterdir())
        assert main(["prepare-data", *args, "-o", str(tmp_path / "out")]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ms-llm prepare-data: error: "), err
        assert message in err, (message, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args   # no output, no temporaries


def test_existing_output_is_refused_unless_overwrite(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    assert main(["prepare-data", "-i", str(src), "--tokenizer", "bytes", "-o", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    assert main(["prepare-data", "-i", str(src), "--tokenizer", "bytes", "-o", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exist" in err and "--overwrite" in err and "ds.bin" in err
    src.write_text("hello again")
    assert main(["prepare-data", "-i", str(src), "--tokenizer", "bytes", "-o", str(tmp_path / "ds"),
                 "--overwrite"]) == 0
    assert len(docs(tmp_path / "ds")[0]) == len("hello again") + 1


def test_a_killed_run_leaves_nothing_under_a_final_name(tmp_path):
    """The input is a pipe we stop feeding: the run is mid-write when it is killed."""
    import signal
    import time

    fifo = tmp_path / "feed.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "ms_llm", "prepare-data", "-i", str(fifo), "--train-tokenizer",
                             "bpe", "--vocab-size", "300", "-o", str(tmp_path / "out" / "ds")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_for(pattern: str) -> None:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "out").glob(pattern)) and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        with open(fifo, "w") as feed:     # the training pass reads the pipe to its end ...
            feed.write("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100)))
        wait_for(".tokenizer.json.tmp*")  # ... (trained: that reader is closed) ...
        with open(fifo, "w") as feed:     # ... the encoding pass opens it again: feed it, then stall
            feed.write("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5000)))
            feed.flush()
            wait_for("ds.bin.tmp*")
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
    finally:
        proc.kill()
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left and all(".tmp" in name for name in left), left     # temporaries only, no final name


def test_tool_script_and_its_errors(tmp_path):
    """tools/prepare_data.py as users run it from a fresh clone (no install, no PYTHONPATH, another
    working directory): same parser, one-line error, exit status 2."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), "-i", str(tmp_path / "x"),
                          "--tokenizer", "bytes", "-o", str(tmp_path / "o")], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 2 and out.stderr == f"prepare_data.py: error: --input: {tmp_path / 'x'} does not " \
        f"exist; give files, folders, a saved Hugging Face dataset or 'stdlib' (the embedded corpus)\n"


def test_parquet_without_pyarrow_names_the_extra(tmp_path, capsys):
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow is installed here")
    except ImportError:
        pass
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    assert main(["prepare-data", "-i", str(tmp_path / "t.parquet"), "--tokenizer", "bytes",
                 "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs pyarrow" in err and "ms_llm[data]" in err


def with_oracles() -> dict:
    """pyarrow and datasets live in .oracles (make oracles), not in .venv."""
    if not (ORACLES / "pyarrow").is_dir() or not (ORACLES / "datasets").is_dir():
        pytest.skip(".oracles/ has no pyarrow / datasets: run `make oracles`")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["PYTHONPATH"], str(ORACLES)]),
            "PYTHONWARNINGS": "ignore"}


def test_parquet_and_saved_hf_dataset(tmp_path):
    env = with_oracles()
    make = (f"import datasets, pyarrow as pa, pyarrow.parquet as pq\n"
            f"texts = {JSONL_TEXTS!r}\n"
            f"pq.write_table(pa.table({{'body': texts, 'n': [1, 2, 3]}}), {str(tmp_path / 't.parquet')!r},"
            f" row_group_size=2)\n"
            f"ds = datasets.Dataset.from_dict({{'text': texts}})\n"
            f"datasets.DatasetDict({{'train': ds, 'test': ds.select([0])}}).save_to_disk({str(tmp_path / 'hf')!r})\n")
    made = subprocess.run([sys.executable, "-c", make], env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    out = cli("-i", str(tmp_path / "t.parquet"), "--text-key", "body", "--tokenizer", "bytes", "-o",
              str(tmp_path / "pq"), env=env)
    assert out.returncode == 0, out.stderr
    assert [bytes(r[:-1].astype(np.uint8)).decode() for r in docs(tmp_path / "pq")] == JSONL_TEXTS
    out = cli("-i", str(tmp_path / "hf"), "--hf-split", "test", "--tokenizer", "bytes", "-o", str(tmp_path / "h"),
              env=env)
    assert out.returncode == 0, out.stderr
    assert [bytes(r[:-1].astype(np.uint8)).decode() for r in docs(tmp_path / "h")] == JSONL_TEXTS[:1]
    out = cli("-i", str(tmp_path / "t.parquet"), "--tokenizer", "bytes", "-o", str(tmp_path / "x"), env=env)
    assert out.returncode == 2
    assert out.stderr == (f"ms-llm prepare-data: error: {tmp_path / 't.parquet'}: no column 'text' (columns: body, n); "
                          f"pass --text-key with the one holding the text\n")


@pytest.mark.mindspore
def test_mindrecord_input_ids_import(tmp_path, capsys):
    from mindspore.mindrecord import FileWriter

    rows = [np.arange(i, i + 5 + 3 * i, dtype=np.int32) for i in range(7)]
    rows[3][1] = 699
    writer = FileWriter(str(tmp_path / "wiki.mindrecord"), shard_num=1, overwrite=True)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "MindFormers-style packed samples")
    writer.write_raw_data([{"input_ids": r} for r in rows])
    writer.commit()
    assert main(["prepare-data", "-i", str(tmp_path / "wiki.mindrecord"), "--input-format", "mindrecord",
                 "-o", str(tmp_path / "mr")]) == 0
    assert [r.tolist() for r in docs(tmp_path / "mr")] == [r.tolist() for r in rows]
    summary = json.loads(capsys.readouterr().out)
    assert (summary["documents"], summary["vocab_size"], summary["dtype"]) == (7, 700, "uint16")
    assert summary["eos_id"] is None
    assert main(["prepare-data", "-i", str(tmp_path / "wiki.mindrecord"), "--vocab-size", "600",
                 "-o", str(tmp_path / "small")]) == 2          # found by its suffix
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "token id 699, not below the vocabulary size 600" in err
    assert not list(tmp_path.glob("small*")) and not list(tmp_path.glob(".small*"))
