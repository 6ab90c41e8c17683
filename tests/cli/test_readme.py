"""Every command the README shows runs as written, from a checkout, in README order.

Commands are the lines of the README's code blocks that start with `ms-llm`, `python` or
`make` (a trailing backslash continues a line, `#` starts a comment). The fast ones run here;
each one that does not is matched by a reason below, so a new README command is either run
or explained, and the README cannot drift from the code again.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Commands not run here, by prefix, with the reason; everything else must exit 0.
NOT_RUN = {
    "make": "the Makefile targets are what CI and `make demo` run",
    "ms-llm demo": "`make demo` runs it",
    "ms-llm train configs/train/llama2_70b_dp2_tp4_pp8.yaml --run-dir /shared": "needs 8 machines",
    "ms-llm train job.yaml": "a user's own job (the same flags run in tests/checkpoint/test_checkpoint_resume.py)",
    "ms-llm prepare-data --input docs/": "a user's own files (tests/data/test_prepare_data.py runs every input kind)",
    "ms-llm prepare-data --input web.jsonl": "a user's own files (tests/data/test_prepare_data.py runs every input kind)",
    "ms-llm prepare-data --input stdlib": "tokenizes the whole standard library (tests/data/test_prepare_data.py)",
    "python bench/": "benchmarks: `make bench` runs them",
    "python -m ms_llm train configs/train/tiny_ms_dp2.yaml": "MindSpore training (tests/mindspore/test_ms_worker.py)",
    "ms-llm train configs/train/tiny_torch_dp2.yaml": "torch training (tests/test_torch_launch.py)",
}


def readme_commands() -> list[str]:
    commands, pending, in_fence = [], "", False
    for raw in (ROOT / "README.md").read_text().splitlines():
        if raw.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if not (in_fence or raw.startswith("    ")):
            pending = ""
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = re.sub(r"\s+#.*$", "", line).strip()
        if re.match(r"^(\.venv/bin/)?(ms-llm|python)\s|^make\s", line):
            commands.append(line.removeprefix(".venv/bin/"))
    return commands


def reason_not_run(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def test_readme_commands_run_as_written(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 20, commands
    # A fresh working folder with the checkout's inputs, so outputs land in tmp_path.
    for name in ("configs", "tools", "bench"):
        os.symlink(ROOT / name, tmp_path / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = []
    for command in commands:
        if reason_not_run(command):
            continue
        argv = shlex.split(command)
        argv = [sys.executable, "-m", "ms_llm", *argv[1:]] if argv[0] == "ms-llm" else [sys.executable, *argv[1:]]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"README command failed: {command}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        assert "Traceback" not in result.stderr, command
        ran.append(command)
    assert len(ran) >= 15, ran


@pytest.mark.parametrize("command", ["make bench", "ms-llm prepare-data --input docs/ x", "python bench/zero.py"])
def test_every_command_not_run_has_a_reason(command):
    assert reason_not_run(command)


def test_readme_names_no_missing_input():
    """Inputs a README command names under configs/ exist in the checkout."""
    for command in readme_commands():
        for word in shlex.split(command):
            if word.startswith("configs/"):
                assert (ROOT / word).exists() or (ROOT / "configs" / word).exists(), (command, word)
