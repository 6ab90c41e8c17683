"""A real guard for "never a file opened outside the folder": an audit hook on `open`.

CPython raises the audit event "open" for builtins.open, io.open and os.open (and so for
every file numpy, json or mmap users open), before the file is opened. Inside
`confine_opens(folder)` an open of a path outside `folder` (and outside the interpreter's and
ms_llm's own files, which lazy imports read) is recorded and refused with a RuntimeError, which
the code under test cannot mistake for an OSError it handles.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import ms_llm

_ALLOWED_ALWAYS = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}] + \
    [Path(ms_llm.__file__).resolve().parent, Path(__file__).resolve().parents[2] / "torch_backend"]
_state: dict = {"roots": None, "escapes": []}


class OpenedOutside(RuntimeError):
    pass


def _hook(event: str, args: tuple) -> None:
    if event != "open" or _state["roots"] is None:
        return
    path = args[0]
    if isinstance(path, int) or path is None:
        return
    resolved = Path(os.fsdecode(path)).resolve()
    if not any(resolved.is_relative_to(root) for root in _state["roots"] + _ALLOWED_ALWAYS):
        _state["escapes"].append(str(resolved))
        raise OpenedOutside(f"opened {resolved} outside {_state['roots']}")


sys.addaudithook(_hook)


@contextlib.contextmanager
def confine_opens(*folders: Path):
    """Refuse and record every open outside `folders` while the block runs; yields the list of escapes."""
    escapes: list[str] = []
    _state["roots"], _state["escapes"] = [Path(f).resolve() for f in folders], escapes
    try:
        yield escapes
    finally:
        _state["roots"] = None
