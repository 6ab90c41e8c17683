"""Two nodes on one machine, over 127.0.0.1: `ms-llm train --nnodes 2` started twice (node
ranks 0 and 1, one data-parallel worker each) trains exactly as one node running both workers,
under torchrun and under msrun.

OMP_NUM_THREADS=1 in every run: torchrun sets it only for several processes per node, and the
number of threads a CPU matmul splits its reductions over changes the last bits of the loss.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ms_llm.nodes import free_port
from ms_llm.processes import descendants
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600                     # a bound on each wait, not a speed requirement
GRACE_S = 30                        # how long the other launchers get once one has failed
NODE = ["--nnodes", "2", "--master-addr", "127.0.0.1"]
# The configs' jobs with a smaller model: the launch, not the model, is what two nodes change.
MODEL = dict(name="tiny_nodes", vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, dtype="float32")


def small(config: str, tmp: Path) -> str:
    """`config` with MODEL and 16-token sequences, written to `tmp`."""
    job = yaml.safe_load((ROOT / config).read_text())
    job["model"], job["train"]["seq_len"] = MODEL, 16
    path = tmp / Path(config).name
    path.write_text(yaml.safe_dump(job))
    return str(path)


def start(config: str, run: Path, name: str, *flags: str) -> subprocess.Popen:
    """One launcher, its output in <name>.out beside the run folder (no pipe to fill up)."""
    with open(run.parent / f"{name}.out", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "ms_llm", "train", config, "--steps", "3", "--run-dir", str(run),
                                 *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def finish(procs: list[subprocess.Popen]) -> list[int]:
    """Exit statuses of the launchers. Past the bound, or GRACE_S after one of them failed (its
    peer would wait for the rendezvous up to torchrun's own 600 s), the ones still running and
    everything they started are killed by PID; past the bound with none failed, the test fails."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(0.2)
    running = [p for p in procs if p.poll() is None]
    pids = [q for p in running for q in [p.pid, *descendants(p.pid)]]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in running:
        p.wait()
    if running and all(p.returncode in (0, -signal.SIGKILL) for p in procs):
        pytest.fail(f"launchers still running after {TIMEOUT_S} s; killed {pids}")
    return [p.returncode for p in procs]


def two_nodes(config: str, tmp: Path) -> tuple[Path, list[int]]:
    """Node ranks 0 and 1 on a free port; once more on another if node 0's store found that port
    taken in between (another process on this machine bound it first: not what is tested here)."""
    for attempt in range(2):
        run, port = tmp / f"two{attempt}", str(free_port())
        nodes = [start(config, run, f"node{r}_{attempt}", *NODE, "--node-rank", str(r), "--master-port", port)
                 for r in (0, 1)]
        codes = finish(nodes)
        logs = [run / "launcher.log", *(tmp / f"node{r}_{attempt}.out" for r in (0, 1))]
        if codes == [0, 0] or not any("EADDRINUSE" in f.read_text() for f in logs if f.is_file()):
            break
    return run, codes


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def outputs(tmp: Path) -> str:
    return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp.glob("*.out")))


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    pytest.param("configs/train/tiny_torch_dp2.yaml", id="torchrun"),
    pytest.param("configs/train/tiny_ms_dp2.yaml", id="msrun", marks=pytest.mark.mindspore),
])
def test_two_nodes_train_like_one(tmp_path, config):
    if "ms_dp2" in config:
        pytest.importorskip("mindspore")
    config = small(config, tmp_path)
    one = tmp_path / "one"
    assert finish([start(config, one, "one")]) == [0], outputs(tmp_path)
    two, codes = two_nodes(config, tmp_path)
    assert codes == [0, 0], outputs(tmp_path)

    assert len(losses(one)) == 3 and losses(two) == losses(one)
    # Both nodes resolved the YAML to the job the single node wrote, but for the run folder.
    assert (two / "config.yaml").read_text().replace(str(two), "RUN") == \
        (one / "config.yaml").read_text().replace(str(one), "RUN")
    assert not (two / "tmp").exists() and not list(two.glob(".config.yaml.*"))
