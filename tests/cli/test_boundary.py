"""Import boundaries, each module checked in a fresh interpreter:
- ms_llm minus ms_llm/mindspore imports neither torch nor mindspore;
- the core (that, minus the CLI layer) imports no backend either, not even inside a function;
- each backend's support, launch, lower and dry_run modules import no framework: the launcher
  asks, prints and starts with them before any worker imports torch or MindSpore."""
import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import ms_llm

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "mindspore")
BACKENDS = ("torch_backend", "ms_llm.mindspore")
# The CLI layer: it dispatches to the backends (lazily, or through their framework-free support.py).
CLI_LAYER = ("ms_llm.__main__", "ms_llm.cli", "ms_llm.commands", "ms_llm.backends", "ms_llm.launch")
SUPPORT = ("torch_backend.support", "ms_llm.mindspore.support", "torch_backend.launch", "ms_llm.mindspore.launch",
           "torch_backend.lower", "torch_backend.dry_run", "ms_llm.mindspore.lower", "ms_llm.mindspore.dry_run")
CHECK = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
         "print(','.join(m for m in sys.argv[2:] if m in sys.modules))")


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def framework_free_modules() -> list[str]:
    names = ["ms_llm"]
    for info in pkgutil.walk_packages(ms_llm.__path__, "ms_llm."):
        if not _within(info.name, ("ms_llm.mindspore", "ms_llm.__main__")):
            names.append(info.name)
    return names


def core_modules() -> list[str]:
    return [m for m in framework_free_modules() if not _within(m, CLI_LAYER)]


def loaded_by(module: str, watched: tuple[str, ...]) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK, module, *watched], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def imports_anywhere(module: str) -> set[str]:
    """Every module an import statement of `module`'s source names, function bodies included."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_ms_llm_imports_no_framework():
    mods = framework_free_modules()
    assert {"ms_llm.strategy.plan", "ms_llm.data.sampler", "ms_llm.cli", "ms_llm.backends"} <= set(mods)
    offenders = {m: hit for m in mods if (hit := loaded_by(m, FRAMEWORKS))}
    assert offenders == {}


def test_core_imports_no_backend():
    mods = core_modules()
    assert "ms_llm.strategy.layout" in mods and "ms_llm.machine" in mods
    assert not any(_within(m, CLI_LAYER) for m in mods)
    offenders = {m: hit for m in mods if (hit := loaded_by(m, BACKENDS))}
    assert offenders == {}
    lazy = {m: sorted(n for n in imports_anywhere(m) if _within(n, BACKENDS + FRAMEWORKS)) for m in mods}
    assert {m: names for m, names in lazy.items() if names} == {}


def test_support_modules_import_no_framework():
    assert {m: loaded_by(m, FRAMEWORKS) for m in SUPPORT} == {m: "" for m in SUPPORT}


def test_boundary_check_can_fail():
    assert loaded_by("torch_backend.model", FRAMEWORKS) == "torch"
    assert loaded_by("ms_llm.backends", BACKENDS) == ",".join(BACKENDS)
    assert "torch_backend.checkpoint" in imports_anywhere("ms_llm.commands.checkpoint")
