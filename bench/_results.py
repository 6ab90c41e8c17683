"""Run one bench script and write what it printed into a Markdown results file, under the
machine (cores, CPU model, memory) and the date: how `make bench` writes bench/results/latest.md.

    .venv/bin/python bench/_results.py bench/results/latest.md bench/zero.py [bench arguments]

The section is appended, or replaces the file's section of the same script in place, so one bench
can be rerun without rerunning them all.

The bench runs as `python bench/zero.py` would run it (same __main__, same argv); its output
still reaches the terminal. A bench that fails appends nothing and passes its exit status on.
"""
from __future__ import annotations

import ast
import io
import os
import platform
import runpy
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path


class _Tee(io.TextIOBase):
    """The terminal and a buffer, so a long bench shows progress while it runs."""

    def __init__(self, out):
        self.out, self.buffer = out, io.StringIO()

    def write(self, text: str) -> int:
        self.out.write(text)
        self.out.flush()
        return self.buffer.write(text)


def machine() -> str:
    """'2 cores, <CPU model>, 7.8 GiB memory' from /proc (Linux); what the OS says elsewhere."""
    model = platform.processor() or platform.machine()
    memory = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        memory = f", {kib / 2**20:.1f} GiB memory"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores, {model}{memory}"


def section(script: Path, output: str, seconds: float) -> str:
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    title = " ".join(doc.split("\n\n")[0].split()) or script.stem           # the docstring's first paragraph
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    return (f"## {script.as_posix()}: {title}\n\nmachine: {machine()}; date: {when}; ran {seconds:.0f} s\n\n"
            f"```\n{output.rstrip()}\n```\n\n")


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) >= 2 else 2
    results, script = Path(sys.argv[1]), Path(sys.argv[2])
    sys.argv = [str(script)] + sys.argv[3:]
    sys.path.insert(0, str(script.resolve().parent))
    tee = _Tee(sys.stdout)
    start = time.perf_counter()
    status: int | str | None = 0
    with redirect_stdout(tee):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            status = exc.code
    if status not in (0, None):
        if isinstance(status, str):
            print(status, file=sys.stderr)
            return 1
        return status
    new = section(script, tee.buffer.getvalue(), time.perf_counter() - start)
    results.write_text(replace_section(results.read_text() if results.exists() else "", script, new))
    return 0


def replace_section(text: str, script: Path, new: str) -> str:
    """`text` with the section headed by `script` replaced by `new`, or `new` appended."""
    head = f"## {script.as_posix()}: "
    at = ("\n" + text).find("\n" + head)
    if at < 0:
        return text + new
    end = text.find("\n## ", at + len(head))
    return text[:at] + new + (text[end + 1:] if end >= 0 else "")

if __name__ == "__main__":
    sys.exit(main())
