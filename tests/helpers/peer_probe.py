"""A peer's own code started once per test module (tests/helpers/*_run_probe.py): the probe writes a
result file, then waits for the test's next spec file, so the peer's framework is imported once for
several checks. ProbeProcess is the test's side of that exchange, next_spec the probe's; standard
library only, as the probes import it beside the peer's packages."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

WAIT_S = 900            # how long a probe waits for the next spec


def next_spec(path: str | Path) -> dict:
    """The spec the test writes to `path` once it has what the probe needs next ({}: stop)."""
    deadline = time.monotonic() + WAIT_S
    while not os.path.isfile(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} after {WAIT_S} s")
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


class ProbeProcess:
    """The probe process, its output in <tmp>/probe.log; `next` is where it waits for its next spec."""

    def __init__(self, name: str, cmd: list[str], tmp: Path, env: dict[str, str], next_path: Path,
                 timeout_s: float = 600, log_tail: int = 3000):
        self.name, self.tmp, self.next, self.timeout_s, self.log_tail = name, tmp, next_path, timeout_s, log_tail
        self.log = open(tmp / "probe.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def read(self, path: Path) -> dict:
        """`path`'s JSON once the probe has written it; the test fails with the probe's log when the
        probe ends first or the bound passes."""
        import pytest

        deadline = time.monotonic() + self.timeout_s
        while not path.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.name} probe ended (exit {self.proc.returncode}) without {path.name}:\n"
                            + (self.tmp / "probe.log").read_text()[-self.log_tail:])
            time.sleep(0.2)
        return json.loads(path.read_text())

    def send(self, spec: dict, to: Path | None = None) -> None:
        """`spec` where the probe waits (`to`, default `next`), whole or not at all."""
        staged = self.tmp / "next.tmp"
        staged.write_text(json.dumps(spec))
        os.replace(staged, to or self.next)

    def stop(self) -> None:
        """Tells a waiting probe to end ({}), then waits for it (killed past 60 s)."""
        if self.proc.poll() is None:
            if not self.next.exists():
                self.next.write_text("{}")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
