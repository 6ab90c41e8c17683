"""Checks for values that come from checkpoint files, which may be damaged or crafted.

Shard file names in the index, the `latest` pointer and the names inside imported Hugging
Face, MindSpore and DCP folders are data, not trusted paths: `confined` is the one check
every read and write of such a name goes through, so a checkpoint cannot make ms_llm read
or write a file outside its folder. Every number (shapes, offsets, block sizes, checksums)
goes through `integer` / `integers` before it sizes an allocation or an offset, so a bad
value is a CheckpointError naming where it was, never an OverflowError or a 3 TiB np.empty.
Every file a read opens goes through `open_regular` (a FIFO in place of an index part or of
`latest` would block open() forever), and every JSON file it parses through `parse_json`, which
bounds the nesting depth before parsing (a list 900 deep parses, then fails every recursive walk
of it with a RecursionError, outside the code that falls back to the previous checkpoint).
"""
from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Optional, TypeVar

import numpy as np

from ms_llm.config.schema import shown
from ms_llm.errors import CheckpointError

T = TypeVar("T")


def confined(folder: str | Path, name: object, field: str) -> Path:
    """`folder / name` after checking that `name` is a relative path without `..` and that it
    resolves (symlinks followed) inside `folder`; else CheckpointError naming `field`."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise CheckpointError(f"{folder}: {field} is {name!r}; expected a file name inside the folder")
    path = folder / name
    if "/" not in name and name not in (".", ".."):
        try:
            plain = not stat.S_ISLNK(os.lstat(path).st_mode)
        except FileNotFoundError:
            return path             # the caller's read says it is missing
        except OSError:
            plain = False           # the full check below says why
        if plain:
            return path             # a plain entry of the folder (a load checks several: one lstat each)
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"{folder}: {field} is {name!r}, which points outside the folder; a checkpoint "
                              "names only its own files (relative, no '..')")
    root = folder.resolve()
    if not path.resolve().is_relative_to(root):
        raise CheckpointError(f"{folder}: {field} is {name!r}, a symbolic link to {path.resolve()} outside the "
                              "folder; copy the file into the checkpoint folder instead")
    return path


# Elements in one tensor, or bytes in one file: past any real checkpoint (8 PiB), far below int64 overflow.
MAX_COUNT = 1 << 53


def integer(value: object, where: str, field: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """`value` if it is a JSON integer (not a bool, not a float) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointError(f"{where}: '{field}' is {shown(value)}; expected an integer in [{lo}, {hi}]")
    return value


def integers(value: object, where: str, field: str, lo: int = 0, hi: int = MAX_COUNT,
             length: Optional[int] = None) -> tuple[int, ...]:
    """A JSON list of integers in [lo, hi] (of `length` items when given)."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        need = f"a list of {length} integers" if length is not None else "a list of integers"
        raise CheckpointError(f"{where}: '{field}' is {shown(value)}; expected {need}")
    if set(map(type, value)) <= {int} and (not value or lo <= min(value) and max(value) <= hi):
        return tuple(value)             # the common case in one pass (an index holds thousands of these)
    return tuple(integer(v, where, f"{field}[{i}]", lo, hi) for i, v in enumerate(value))


def open_regular(path: str | Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of `path` and its fstat, opened without blocking: only a regular
    file is kept (a FIFO opened for reading would wait for a writer forever), else a
    CheckpointError naming it. FileNotFoundError is left to the caller, which knows what the
    file is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd, st


def read_regular(path: str | Path) -> bytes:
    """The bytes of a regular file (open_regular)."""
    fd, _ = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None


# Arrays and objects in one checkpoint JSON file, one inside another: a head nests about 7 deep
# (a tensor's split), a hand-saved training state a few more. Far below the interpreter's recursion limit.
MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_SYNTAX = np.zeros(256, bool)
_SYNTAX[list(b'[]{}"')] = True
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of JSON text `raw` nest (brackets inside strings do not
    count), in a few numpy passes over its quotes and brackets: a sixth of json.loads' time."""
    if b"\\" in raw:                   # escaped quotes: drop the strings whole (slower, rare in checkpoints)
        chars = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
        steps = _STEP[chars]
    else:
        chars = np.frombuffer(raw, np.uint8)
        chars = chars[_SYNTAX[chars]]
        steps = _STEP[chars]
        steps[(np.cumsum(chars == ord('"'), dtype=np.int64) & 1).astype(bool)] = 0     # inside a string
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.size else 0


def parse_json(raw: bytes, where: str) -> Any:
    """json.loads of a checkpoint file's bytes, after checking they nest at most MAX_DEPTH deep;
    else (or for text that is not JSON) a CheckpointError naming `where`."""
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{where}: JSON nested {depth} deep; a checkpoint's files nest at most {MAX_DEPTH} "
                              "levels (the file is damaged or crafted)")
    try:
        return json.loads(raw.decode())     # UTF-8 only: in it every byte '"', '[' or '{' is that character
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({type(exc).__name__}: {exc})") from None


class CheckedOnUse(Mapping[str, T]):
    """A JSON object's entries, each parsed and checked by `parse(key, raw value)` when first
    looked up: a load that wants some entries (one pipeline stage's tensors of an index, some
    of a shard file's header) pays for those only, and a malformed entry raises CheckpointError
    on use, inside the caller's fallback."""

    def __init__(self, raw: dict, parse: Callable[[str, object], T]):
        self._raw, self._parse = raw, parse
        self._parsed: dict[str, T] = {}

    def __getitem__(self, key: str) -> T:
        entry = self._parsed.get(key)
        if entry is None:
            entry = self._parsed[key] = self._parse(key, self._raw[key])
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)
