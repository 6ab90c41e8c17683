"""The peers' training-checkpoint formats `ms-llm import-run` and `export-run` know, and where each
format's code lives.

A format module exposes exactly:
    detect(folder: Path) -> bool            cheap: file names, a small JSON or a header only
    read_run(folder: Path, config: Optional[Path]) -> ForeignRun     (run_state.py)
    write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path
                                            a folder the peer's own trainer loads
Modules that read torch pickles live in torch_backend/, the MindSpore one in ms_llm/mindspore/: each
is imported only when its format is asked for or probed, so this module imports neither framework.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from ms_llm.errors import CheckpointError

PEERS: dict[str, str] = {
    "megatron": "torch_backend.interop.megatron",
    "deepspeed": "torch_backend.interop.deepspeed",
    "torchtitan": "torch_backend.interop.torchtitan",
    "mindformers": "ms_llm.mindspore.interop.mindformers",
    "mindformers2": "ms_llm.mindspore.interop.mindformers2",      # writes the 2.x layout; read by mindformers
}


def peer_module(fmt: str) -> ModuleType:
    """The module of format `fmt`; one line when the name is unknown or its framework is missing."""
    if fmt not in PEERS:
        raise CheckpointError(f"format {fmt!r} is not one ms_llm reads or writes; use one of {', '.join(PEERS)}")
    try:
        return importlib.import_module(PEERS[fmt])
    except ImportError as exc:
        framework = "MindSpore" if fmt.startswith("mindformers") else "torch"
        need = f"; the {fmt} format needs {framework} installed" if exc.name in ("torch", "mindspore") else ""
        raise CheckpointError(f"format {fmt!r}: {PEERS[fmt]} cannot be imported ({exc}){need}") from None


def detect_format(folder: str | Path) -> str:
    """The format whose module recognises `folder`. Formats whose module cannot be imported here
    (no torch, no MindSpore) are skipped; none matching is one line naming the formats tried."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such file or folder")
    tried, unavailable, matched = [], [], []
    for fmt in PEERS:
        try:
            module = peer_module(fmt)
        except CheckpointError:
            unavailable.append(fmt)
            continue
        tried.append(fmt)
        if module.detect(folder):
            matched.append(fmt)
    if len(matched) == 1:
        return matched[0]
    if matched:
        raise CheckpointError(f"{folder}: looks like a checkpoint of {' and of '.join(matched)}; name its format with "
                              f"--format {'|'.join(matched)}")
    looked = [f"not {' / '.join(tried)}"] if tried else []
    looked += [f"{', '.join(unavailable)} cannot be read here (their code does not import)"] if unavailable else []
    raise CheckpointError(f"{folder}: not a checkpoint of a format ms_llm knows ({'; '.join(looked)}); name it with "
                          f"--format {'|'.join(PEERS)}")
