"""Import boundaries.

Frameworks, each module checked in a fresh interpreter (one interpreter forks a pristine child
per module, so nothing one import loads is seen by the next):
- ms_llm minus ms_llm/mindspore imports neither torch nor mindspore;
- the core (that, minus the CLI layer) imports no backend either, not even inside a function;
- each backend's support, launch, lower and dry_run modules import no framework: the launcher
  asks, prints and starts with them before any worker imports torch or MindSpore.

Layers, read from the source of every module (function bodies too): the rooms of LAYERS, bottom
up, and an import only ever points at a room on a lower line. That rules out a package cycle
and an arrow running back up; a new package fails here until it is given its line."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "mindspore")
BACKENDS = ("torch_backend", "ms_llm.mindspore")
# The CLI layer: it dispatches to the backends (lazily, or through their framework-free support.py).
CLI_LAYER = ("ms_llm.__main__", "ms_llm.cli", "ms_llm.commands", "ms_llm.backends", "ms_llm.launch")
SUPPORT = ("torch_backend.support", "ms_llm.mindspore.support", "torch_backend.launch", "ms_llm.mindspore.launch",
           "torch_backend.lower", "torch_backend.dry_run", "ms_llm.mindspore.lower", "ms_llm.mindspore.dry_run")
# Runs as `python -c CHECK watched,... module ...`: forks once per module, so each import starts
# from the same pristine interpreter; prints {module: "loaded,watched"} ("!error" if it failed).
# numpy and yaml, which every core module loads and which load no framework, are imported once
# before the forks; the parent checks that nothing watched is loaded yet.
CHECK = """
import importlib, json, os, sys
import numpy, yaml
watched, found = sys.argv[1].split(","), {}
assert not [m for m in watched if m in sys.modules], watched
for module in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            msg = ",".join(m for m in watched if m in sys.modules)
        except BaseException as exc:
            msg = "!" + repr(exc)
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        found[module] = f.read()
    os.waitpid(pid, 0)
print(json.dumps(found))
"""
# Bottom up. A room is a package or a top-level module; checkpoint's engine and interop are rooms
# of their own (the API sits between them).
LAYERS = (
    ("ms_llm.errors", "ms_llm.durable", "ms_llm.processes", "ms_llm.init"),
    ("ms_llm.config", "ms_llm.data"),
    ("ms_llm.rope", "ms_llm.strategy"),
    ("ms_llm.job", "ms_llm.zero", "ms_llm.machine", "ms_llm.checkpoint.storage"),
    ("ms_llm.checkpoint", "ms_llm.convert"),
    ("ms_llm.checkpoint.interop", "ms_llm.run"),
    ("ms_llm.nodes",),
    ("ms_llm.elastic", "ms_llm.mindspore", "torch_backend"),
    ("ms_llm.backends",),
    ("ms_llm.launch",),
    ("ms_llm.commands",),
    ("ms_llm.cli",),
    ("ms_llm.__main__",),
)
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def checkout_modules(package: str) -> list[str]:
    """Every module of `package` in the checkout, read from disk (walk_packages would import them)."""
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def framework_free_modules() -> list[str]:
    return [m for m in checkout_modules("ms_llm") if not _within(m, ("ms_llm.mindspore", "ms_llm.__main__"))]


def core_modules() -> list[str]:
    return [m for m in framework_free_modules() if not _within(m, CLI_LAYER)]


def loaded_by_each(modules: list[str], watched: tuple[str, ...]) -> dict[str, str]:
    """{module: the watched modules importing it loads, comma-joined}, each in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", CHECK, ",".join(watched), *modules], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert {m: v for m, v in found.items() if v.startswith("!")} == {}
    return found


def loaded_by(module: str, watched: tuple[str, ...]) -> str:
    return loaded_by_each([module], watched)[module]


def imports_anywhere(module: str) -> set[str]:
    """Every module an import statement of `module`'s source names, function bodies included."""
    path = ROOT.joinpath(*module.split("."))
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """{framework-free module: the frameworks and backends importing it loads}, one pass."""
    return {m: set(filter(None, hit.split(","))) for m, hit in
            loaded_by_each(framework_free_modules(), FRAMEWORKS + BACKENDS).items()}


def test_ms_llm_imports_no_framework(loaded):
    assert {"ms_llm.strategy.plan", "ms_llm.data.sampler", "ms_llm.cli", "ms_llm.backends"} <= set(loaded)
    assert {m: hit for m, hit in loaded.items() if hit & set(FRAMEWORKS)} == {}


def test_core_imports_no_backend(loaded):
    mods = core_modules()
    assert "ms_llm.strategy.layout" in mods and "ms_llm.machine" in mods
    assert not any(_within(m, CLI_LAYER) for m in mods)
    assert {m: loaded[m] for m in mods if loaded[m] & set(BACKENDS)} == {}
    lazy = {m: sorted(n for n in imports_anywhere(m) if _within(n, BACKENDS + FRAMEWORKS)) for m in mods}
    assert {m: names for m, names in lazy.items() if names} == {}


def test_support_modules_import_no_framework():
    assert loaded_by_each(list(SUPPORT), FRAMEWORKS) == {m: "" for m in SUPPORT}


def test_boundary_check_can_fail():
    assert loaded_by("torch_backend.model", FRAMEWORKS) == "torch"
    assert loaded_by("ms_llm.backends", BACKENDS) == ",".join(BACKENDS)
    assert "torch_backend.dcp" in imports_anywhere("ms_llm.commands.checkpoint")


def room_of(module: str) -> str:
    """The innermost room of LAYERS holding `module` (KeyError: a module no line places)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LEVEL:
            return ".".join(parts[:n])
    raise KeyError(module)


def all_modules() -> list[str]:
    """Every module of ms_llm and torch_backend (ms_llm/__init__.py is empty: no room needed)."""
    return [m for m in checkout_modules("ms_llm") + checkout_modules("torch_backend") if m != "ms_llm"]


def arrows(modules: list[str]) -> set[tuple[str, str, str]]:
    """(importing module, imported module, its room) for every import of our own code between
    rooms; `from a.b import name` counts as an import of a.b unless a.b.name is a module."""
    found = set()
    for module in modules:
        for name in imports_anywhere(module):
            if name.split(".")[0] not in ("ms_llm", "torch_backend"):
                continue
            target = name if _is_module(name) else name.rsplit(".", 1)[0]
            if _is_module(target) and room_of(target) != room_of(module):
                found.add((module, target, room_of(target)))
    return found


def _is_module(name: str) -> bool:
    """A module or package file of the checkout (read from disk: nothing is imported)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward(edges: set[tuple[str, str, str]]) -> list[str]:
    """The arrows that do not point down a line: into the same line or above."""
    return sorted(f"{m} -> {t}" for m, t, room in edges if LEVEL[room] >= LEVEL[room_of(m)])


def test_every_module_has_a_room():
    unplaced = []
    for m in all_modules():
        try:
            room_of(m)
        except KeyError:
            unplaced.append(m)
    assert unplaced == [], "give each new package or top-level module its line in LAYERS"


def test_imports_point_down_the_layers():
    edges = arrows(all_modules())
    assert ("ms_llm.run.checkpoints", "ms_llm.checkpoint.reader", "ms_llm.checkpoint") in edges
    assert upward(edges) == []


def test_layer_check_can_fail():
    # checkpoint/ importing the run layer (as its trainer glue once did), and a cycle between two rooms
    assert upward({("ms_llm.checkpoint.reader", "ms_llm.run.folder", "ms_llm.run")}) == [
        "ms_llm.checkpoint.reader -> ms_llm.run.folder"]
    assert upward({("ms_llm.config.model", "ms_llm.data.sampler", "ms_llm.data"),
                   ("ms_llm.data.sampler", "ms_llm.config.model", "ms_llm.config")}) != []
