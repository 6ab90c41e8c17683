"""Every command the README and the docs/ pages show runs as written, from a checkout, in page order.

Commands are the lines of a page's code blocks that start with `ms-llm`, `python` or `make` (a
trailing backslash continues a line, `#` starts a comment). The fast ones run here, each page in
a fresh folder of its own (a page's later commands may use what its earlier ones wrote); each
one that does not run is matched by a reason below, so a new command is either run or
explained, and the pages cannot drift from the code again. The files and modules the pages name
must exist too.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

# Commands not run here, by prefix (the longest matching prefix wins), with the reason;
# everything else must exit 0.
NOT_RUN = {
    "make": "the Makefile targets are what CI and `make demo` run",
    "ms-llm demo": "`make demo` runs it",
    "ms-llm train configs/train/llama2_70b_dp2_tp4_pp8.yaml --run-dir /shared": "needs 8 machines",
    "ms-llm train configs/train/llama3_70b_h100_dp8_tp8_pp4.yaml --run-dir /shared": "needs 32 machines with GPUs",
    "ms-llm convert-checkpoint /shared/": "a cluster run's checkpoints (docs/checkpoints.md runs every conversion "
                                         "on a tiny run it trains)",
    "ms-llm import-run /shared/": "a peer's run (tests/checkpoint/test_import_run.py and each format's tests import "
                                  "runs the peers write)",
    "ms-llm train runs/imported/job.yaml": "an imported run (tests/checkpoint/test_import_run.py trains one)",
    "ms-llm export-run /shared/": "a cluster run's checkpoints (tests/checkpoint/test_import_run.py exports one)",
    "ms-llm train job.yaml": "a user's own job (the same flags run in tests/checkpoint/test_checkpoint_resume.py)",
    "ms-llm train job.yaml --run-dir runs/a --elastic": "a user's own job (--elastic runs in "
                                                        "tests/elastic/test_elastic_faults.py)",
    "ms-llm prepare-data --input docs/": "a user's own files (tests/data/test_prepare_data.py runs every input kind)",
    "ms-llm prepare-data --input web.jsonl": "a user's own files (tests/data/test_prepare_data.py runs every input kind)",
    "ms-llm prepare-data --input stdlib": "tokenizes the whole standard library (tests/data/test_prepare_data.py)",
    "ms-llm convert-strategy .oracles/": "MindFormers' own configs, installed by `make oracles` "
                                        "(tests/convert/test_convert_deepseek.py converts every pretrain config)",
    "python bench/": "benchmarks: `make bench` runs them",
    "python -m ms_llm train configs/train/tiny_ms_dp2.yaml": "MindSpore training on msrun "
                                                             "(tests/mindspore/test_ms_train.py)",
    "ms-llm train configs/train/tiny_torch_dp2.yaml": "torch training on torchrun (tests/torch/test_torch_train.py)",
    "ms-llm train configs/train/tiny_deepseek_ms_dp2.yaml": "MindSpore training on msrun "
                                                            "(tests/mindspore/test_ms_deepseek_train.py)",
}

# Commands each page must show at least, and how many must run here in all.
MIN_COMMANDS = {"README.md": 8, "docs/backends.md": 5, "docs/checkpoints.md": 10, "docs/converters.md": 5,
                "docs/data.md": 3, "docs/elastic.md": 3, "docs/moe.md": 5, "docs/performance.md": 2}
MIN_RUN = 25


def doc_commands(doc: str) -> list[str]:
    commands, pending, in_fence = [], "", False
    for raw in (ROOT / doc).read_text().splitlines():
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
    prefixes = [p for p in NOT_RUN if command.startswith(p)]
    return NOT_RUN[max(prefixes, key=len)] if prefixes else None


def run_as_written(command: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one page command, in the current folder. `ms-llm` runs
    through its entry point in this process (the same code path, without an interpreter start
    and its imports per command); `python ...` in a subprocess, as written."""
    argv = shlex.split(command)
    if argv[0] != "ms-llm":
        result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600)
        return result.returncode, result.stdout + result.stderr
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv[1:])
        except SystemExit as exc:                      # argparse: --help, a bad flag
            code = exc.code
    return code or 0, out.getvalue()


@pytest.mark.slow                # runs every page's commands, training included: CI, not the inner loop
@pytest.mark.parametrize("doc", DOCS)
def test_commands_run_as_written(doc, tmp_path, monkeypatch):
    # A fresh working folder with the checkout's inputs, so outputs land in tmp_path.
    for name in ("configs", "tools", "bench"):
        os.symlink(ROOT / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    for command in doc_commands(doc):
        if reason_not_run(command):
            continue
        code, output = run_as_written(command)
        assert code == 0, f"{doc} command failed: {command}\n{output[-4000:]}"
        assert "Traceback" not in output, (doc, command)


def test_every_page_shows_its_commands():
    """Each page keeps its commands, every page is linked from the README, and most commands run."""
    assert set(MIN_COMMANDS) == set(DOCS), "a page was added or removed: give it a minimum in MIN_COMMANDS"
    counts = {doc: len(doc_commands(doc)) for doc in DOCS}
    assert all(counts[doc] >= n for doc, n in MIN_COMMANDS.items()), counts
    ran = [c for doc in DOCS for c in doc_commands(doc) if not reason_not_run(c)]
    assert len(ran) >= MIN_RUN, ran
    readme = (ROOT / "README.md").read_text()
    assert all(f"]({doc})" in readme for doc in DOCS if doc.startswith("docs/")), "link every docs/ page"
    assert len(readme.splitlines()) <= 200, "README.md: 200 lines at most; the rest goes to docs/"


@pytest.mark.parametrize("command", ["make bench", "ms-llm prepare-data --input docs/ x", "python bench/zero.py",
                                     "ms-llm train job.yaml --run-dir runs/a --elastic --min-ranks 2"])
def test_every_command_not_run_has_a_reason(command):
    assert reason_not_run(command)


def test_longest_prefix_gives_the_reason():
    assert "test_elastic_faults" in reason_not_run("ms-llm train job.yaml --run-dir runs/a --elastic")
    assert "test_checkpoint_resume" in reason_not_run("ms-llm train job.yaml --run-dir runs/a --max-restarts 3")


@pytest.mark.parametrize("doc", DOCS)
def test_pages_name_no_missing_input(doc):
    """Inputs a command names under configs/ exist in the checkout."""
    for command in doc_commands(doc):
        for word in shlex.split(command):
            if word.startswith("configs/"):
                assert (ROOT / word).exists() or (ROOT / "configs" / word).exists(), (doc, command, word)


def _module_exists(dotted: str) -> bool:
    """`a.b.c` is a module or package of the checkout, or a name defined at the top of one."""
    path = ROOT.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return True
    parent, _, name = dotted.rpartition(".")
    source = ROOT.joinpath(*parent.split("."))
    source = source.with_suffix(".py") if source.with_suffix(".py").is_file() else source / "__init__.py"
    return source.is_file() and re.search(rf"^(def|class) {name}\b|^{name}\s*[:=]", source.read_text(), re.M) is not None


@pytest.mark.parametrize("doc", DOCS)
def test_pages_name_no_missing_file(doc):
    """Every link, checkout path (`ms_llm/...`, `tests/...`) and module (`ms_llm.zero.engine`) a page
    quotes exists; placeholders (`<run>`, `bench/_*.py`) are left alone."""
    text = (ROOT / doc).read_text()
    missing = [link for link in re.findall(r"\]\(([^)\s]+)\)", text)
               if "://" not in link and not (ROOT / doc).parent.joinpath(link).exists()]
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.search(r"[<*]", span):
            continue
        for word in re.findall(r"[\w./-]+", span):
            word = word.rstrip(".")
            if re.match(r"^(ms_llm|torch_backend|tests|bench|tools|configs|docs)/", word):
                if not (ROOT / word).exists():
                    missing.append(word)
            elif re.match(r"^(ms_llm|torch_backend)\.\w", word) and not _module_exists(word):
                missing.append(word)
    assert not missing, (doc, missing)
