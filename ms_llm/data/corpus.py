"""Token files: the embedded default corpus and memory-mapped loading.

The default corpus is the Python standard library's own source, present on every machine
with Python, so the demo and tests need no download. It is tokenized once into
<cache>/stdlib-<python version>.bin (uint16) with a JSON sidecar, written atomically.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from ms_llm.data.tokenizer import ByteTokenizer
from ms_llm.errors import ConfigError

DEFAULT_MAX_BYTES = 8 * 2**20


def build_stdlib_corpus(cache_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Tokenize stdlib *.py files in sorted order until max_bytes; return the token file."""
    import platform

    cache_dir = Path(cache_dir)
    out = cache_dir / f"stdlib-py{platform.python_version()}-{max_bytes}.bin"
    if out.is_file() and out.with_suffix(".json").is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = ByteTokenizer()
    pieces, total, files = [], 0, 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pieces.append(tok.encode(data))
        total += len(data) + 1
        files += 1
        if total >= max_bytes:
            break
    tokens = np.concatenate(pieces).astype(np.uint16)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tokens.tofile(tmp)
    os.replace(tmp, out)
    meta = {"source": str(stdlib), "files": files, "tokens": int(tokens.size), "dtype": "uint16",
            "tokenizer": "bytes+specials", "vocab_size": tok.vocab_size}
    tmp_meta = out.with_suffix(f".json.tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, out.with_suffix(".json"))
    return out


def load_tokens(path: Path, dtype: str = "uint16") -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"train.data.source: token file {path} does not exist; give a path to a "
                          f"{dtype} token file or 'stdlib' for the embedded corpus")
    size = path.stat().st_size
    width = np.dtype(dtype).itemsize
    if size == 0 or size % width:
        raise ConfigError(f"train.data.source: {path} has {size} bytes, not a whole number of {dtype} tokens")
    return np.memmap(path, dtype=dtype, mode="r")
