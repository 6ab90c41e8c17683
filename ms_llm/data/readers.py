"""Input readers for data preparation: each yields one document (a str) at a time, in order.

JSON Lines (--text-key), plain text files (one file, one document), folders of either (walked in
sorted order), Parquet (pyarrow), a Hugging Face dataset saved with save_to_disk (datasets), and
the embedded corpus ('stdlib'). pyarrow and datasets are optional: imported only when such an
input is given, with a one-line error naming the extra to install when missing.

A bad document stops the run with its file and line (ConfigError); see ms_llm.data.prepare for
the policy on invalid UTF-8 and empty documents.
"""
from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ms_llm.data.corpus import DEFAULT_MAX_BYTES
from ms_llm.errors import ConfigError

FORMATS = ("auto", "text", "jsonl", "parquet", "hf", "mindrecord")
STDLIB = "stdlib"
BATCH_CHARS = 1 << 20     # documents per batch: until ~1 MB of text ...
BATCH_DOCS = 1024         # ... or this many
DATA_EXTRA = "pip install 'ms_llm[data]' (or: pip install pyarrow datasets)"


@dataclass
class Counts:
    """What a preparation run has seen so far; the summary reports it."""

    documents: int = 0
    tokens: int = 0
    characters: int = 0
    max_token_id: int = -1
    skipped_empty: int = 0
    skipped_invalid_utf8: int = 0


# ---------------------------------------------------------------- readers: each yields str documents

def _not_utf8(path: Path, line: int, raw: bytes, exc: UnicodeDecodeError) -> ConfigError:
    column = exc.start - raw.rfind(b"\n", 0, exc.start)
    return ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); convert the "
                       f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pass --skip-invalid-utf8 to count and skip "
                       f"such documents")


def read_text(path: Path, counts: Counts, skip_invalid: bool) -> Iterator[str]:
    """A plain text file is one document."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not skip_invalid:
            raise _not_utf8(path, raw.count(b"\n", 0, exc.start) + 1, raw, exc) from None
        counts.skipped_invalid_utf8 += 1
        return
    yield text


def read_jsonl(path: Path, key: str, counts: Counts, skip_invalid: bool) -> Iterator[str]:
    """JSON Lines: one object per line, the document under `key`; blank lines are ignored."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.isspace():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if not skip_invalid:
                    raise _not_utf8(path, lineno, raw, exc) from None
                counts.skipped_invalid_utf8 += 1
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{lineno}: not a JSON object ({exc}); JSON Lines input holds one "
                                  f"object per line") from None
            text = row.get(key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object with a "
                                      f"{key!r} key")
                if key not in row:
                    raise ConfigError(f"{path}:{lineno}: no {key!r} key (keys: {', '.join(map(str, row)) or 'none'}); "
                                      f"pass --text-key with the one holding the text")
                raise ConfigError(f"{path}:{lineno}: {key!r} is {type(text).__name__}, not a string")
            if "\\u" in line and _lone_surrogate(text):     # "\ud800" escapes decode to no UTF-8 at all
                if not skip_invalid:
                    raise ConfigError(f"{path}:{lineno}: {key!r} holds a lone UTF-16 surrogate escape (\\ud800-"
                                      f"\\udfff), which is not text; fix the line or pass --skip-invalid-utf8")
                counts.skipped_invalid_utf8 += 1
                continue
            yield text


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_parquet(path: Path, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: Parquet input needs pyarrow, which is not installed: {DATA_EXTRA}") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid and friends
        raise ConfigError(f"{path}: not a Parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise ConfigError(f"{path}: no column {key!r} (columns: {', '.join(names)}); pass --text-key with the "
                          f"one holding the text")
    row = 0
    for batch in pf.iter_batches(columns=[key], batch_size=BATCH_DOCS):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row}: {key!r} is {type(text).__name__}, not a string")
            yield text


def read_hf_dataset(path: Path, key: str, split: str) -> Iterator[str]:
    """A Hugging Face dataset saved with save_to_disk (memory-mapped Arrow, read in batches)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{path}: a Hugging Face dataset needs the datasets library, which is not installed: "
                          f"{DATA_EXTRA}") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path}: no split {split!r} (splits: {', '.join(ds)}); pass --hf-split")
        ds = ds[split]
    if key not in ds.column_names:
        raise ConfigError(f"{path}: no column {key!r} (columns: {', '.join(ds.column_names)}); pass --text-key "
                          f"with the one holding the text")
    ds = ds.select_columns([key]).with_format(None)
    row = 0
    for start in range(0, len(ds), BATCH_DOCS):
        for text in ds[start:start + BATCH_DOCS][key]:
            row += 1
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row}: {key!r} is {type(text).__name__}, not a string")
            yield text


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The embedded corpus's documents: the standard library's *.py files, the same selection and
    order as ms_llm.data.corpus.build_stdlib_corpus (sorted, no tests, up to max_bytes)."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or not path.is_file():
            continue
        files.append(path)
        total += path.stat().st_size + 1
        if total >= max_bytes:
            break
    return files


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_dict.json", "dataset_info.json", "state.json"))


def expand_inputs(inputs: list[str], fmt: str = "auto") -> list[tuple[str, Path]]:
    """(format, path) per input file, folders walked in sorted order (hidden names skipped)."""
    out: list[tuple[str, Path]] = []
    for arg in inputs:
        if arg == STDLIB and fmt in ("auto", "text"):
            out += [("text", p) for p in stdlib_files()]
            continue
        path = Path(arg)
        if not path.exists():
            raise ConfigError(f"--input: {arg} does not exist; give files, folders, a saved Hugging Face dataset "
                              f"or '{STDLIB}' (the embedded corpus)")
        if fmt == "hf" or (fmt == "auto" and is_hf_dataset(path)):
            out.append(("hf", path))
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                raise ConfigError(f"--input: folder {arg} holds no files")
            out += [(fmt if fmt != "auto" else _format_of(p), p) for p in files]
        else:
            out.append((fmt if fmt != "auto" else _format_of(path), path))
    return out


def _format_of(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(path.suffix, "text")


def read_documents(files: list[tuple[str, Path]], counts: Counts, text_key: str = "text",
                   skip_invalid_utf8: bool = False, hf_split: str = "train") -> Iterator[str]:
    """Every document of every input in order; empty ones counted in `counts` and dropped."""
    for fmt, path in files:
        if fmt == "text":
            docs = read_text(path, counts, skip_invalid_utf8)
        elif fmt == "jsonl":
            docs = read_jsonl(path, text_key, counts, skip_invalid_utf8)
        elif fmt == "parquet":
            docs = read_parquet(path, text_key)
        elif fmt == "hf":
            docs = read_hf_dataset(path, text_key, hf_split)
        else:
            raise ConfigError(f"--input-format {fmt}: {path} cannot be read as text documents")
        for text in docs:
            if text and not text.isspace():
                yield text
            else:
                counts.skipped_empty += 1


def batched(docs: Iterable[str], max_chars: int | None = None) -> Iterator[list[str]]:
    """Documents in lists of up to `max_chars` characters (BATCH_CHARS when not given) or BATCH_DOCS."""
    limit = BATCH_CHARS if max_chars is None else max_chars
    batch, chars = [], 0
    for text in docs:
        batch.append(text)
        chars += len(text)
        if chars >= limit or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


