"""The core imports neither torch nor mindspore: each module checked in a fresh interpreter."""
import pkgutil
import subprocess
import sys
from pathlib import Path

import ms_llm

ROOT = Path(__file__).resolve().parents[1]
CHECK = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
         "print(','.join(f for f in ('torch', 'mindspore') if f in sys.modules))")


def core_modules() -> list[str]:
    names = ["ms_llm"]
    for info in pkgutil.walk_packages(ms_llm.__path__, "ms_llm."):
        if info.name.startswith("ms_llm.mindspore") or info.name == "ms_llm.__main__":
            continue
        names.append(info.name)
    return names


def frameworks_loaded_by(module: str) -> str:
    out = subprocess.run([sys.executable, "-c", CHECK, module], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_core_imports_no_framework():
    mods = core_modules()
    assert {"ms_llm.strategy.plan", "ms_llm.data.sampler", "ms_llm.cli"} <= set(mods)
    offenders = {m: hit for m in mods if (hit := frameworks_loaded_by(m))}
    assert offenders == {}


def test_boundary_check_can_fail():
    assert frameworks_loaded_by("torch_backend.model") == "torch"
