"""MindRecord datasets (what MindFormers' conversion scripts write) read for `ms-llm prepare-data
--input-format mindrecord`: MindSpore's own reader, so it lives in the MindSpore package."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from ms_llm.errors import ConfigError

MINDRECORD_COLUMN = "input_ids"
CHUNK_TOKENS = 1 << 20


def mindrecord_chunks(path: str) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(flat ids, row lengths, 0) for ~1M tokens of rows at a time, in the file's order."""
    from mindspore.mindrecord import FileReader
    if not Path(path).is_file():
        raise ConfigError(f"--input: {path} does not exist; give a MindRecord file (e.g. wiki.mindrecord0)")
    try:
        reader = FileReader(path, columns=[MINDRECORD_COLUMN])
    except Exception as exc:  # MindSpore raises RuntimeError / ParamValueError / its own MRM errors
        raise ConfigError(f"{path}: cannot read as MindRecord with an {MINDRECORD_COLUMN!r} column "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    try:
        rows, tokens = [], 0
        for index, row in enumerate(reader.get_next()):
            ids = np.asarray(row[MINDRECORD_COLUMN]).reshape(-1)
            if ids.size and int(ids.min()) < 0:
                raise ConfigError(f"{path}: row {index}: negative token id {int(ids.min())} in "
                                  f"{MINDRECORD_COLUMN!r}")
            rows.append(ids)
            tokens += ids.size
            if tokens >= CHUNK_TOKENS:
                yield _chunk(rows)
                rows, tokens = [], 0
        if rows:
            yield _chunk(rows)
    finally:
        reader.close()


def _chunk(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    return np.concatenate(rows).astype(np.int64), np.array([r.size for r in rows], np.int64), 0
