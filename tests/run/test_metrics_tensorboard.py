"""metrics.jsonl's numbers as TensorBoard events (ms_llm/run/tensorboard.py), read back through
tensorboardX's own Event proto: two launches of one run (the second resumes from step 2 and
replays steps 3-4), and a run without tensorboardX. Each case runs in a fresh interpreter, so the
check that a MindSpore worker never loads torch for tensorboardX sees a clean sys.modules."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"

WRITE = """
import sys
from pathlib import Path
from ms_llm.run.metrics import MetricsLogger, StepMetrics
path = Path(sys.argv[1]) / "metrics.jsonl"
nan = float("nan")

def launch(first, last, resumed=None):
    log = MetricsLogger(path, total_steps=5, every=100)
    if resumed is not None:
        log.event(resumed_from="checkpoints/step-2", resumed_step=resumed)
    for s in range(first, last + 1):
        m = StepMetrics(step=s, loss=4.0 - 0.3 * s + (0.05 if resumed else 0), lr=1e-3 * s, tokens_per_s=1000.0 + s,
                        mfu=0.01 * s, memory_gb=0.5, grad_norm=nan if s == 1 else 1.0 / s, step_time_s=0.1)
        if s % 2 == 0:
            m.extra["val_loss"] = 4.5 - 0.2 * s
        log.log(m)
        if s == 2:
            log.event(checkpoint_step=2, stall_s=0.01, wait_s=0.0, bytes=1234)
    log.event(event="done", steps=last)
    log.close()

launch(1, 4)
launch(3, 5, resumed=2)
print("torch loaded:", "torch" in sys.modules)
"""

READ = """
import json, struct, sys
from pathlib import Path
from tensorboardX.proto import event_pb2
scalars = {}
for path in sorted(Path(sys.argv[1]).glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4                          # length, its CRC, the record, its CRC
        if event.session_log.status == event.session_log.START:    # purge_step, as TensorBoard applies it
            scalars = {t: [(s, v) for s, v in pts if s < event.step] for t, pts in scalars.items()}
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
print(json.dumps(scalars))
"""


def python(script: str, *args: str, tensorboardx: bool) -> str:
    env = dict(os.environ)
    if tensorboardx:
        if not (ORACLES / "tensorboardX").is_dir():
            pytest.fail(".oracles/ has no tensorboardX: run `make oracles` (or pip install 'ms_llm[report]')")
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ORACLES)])
    else:     # tensorboardX hidden even where it is installed
        script = "import sys; sys.modules['tensorboardX'] = None\n" + script
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_events_hold_the_scalars_of_metrics_jsonl_once_per_step_across_a_resume(tmp_path):
    out = python(WRITE, str(tmp_path), tensorboardx=True)
    assert "torch loaded: False" in out                 # tensorboardX did not pull torch into the process
    records = read_metrics(tmp_path / "metrics.jsonl")
    events = json.loads(python(READ, str(tmp_path / "tensorboard"), tensorboardx=True))

    # What metrics.jsonl says, the later record of a replayed step winning, as TensorBoard shows it.
    expected: dict[str, dict[int, float]] = {}
    for r in records:
        if "loss" in r:
            for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"),
                             ("mfu", "train/mfu"), ("memory_gb", "train/memory_gb"),
                             ("grad_norm", "train/grad_norm"), ("val_loss", "val/loss")):
                if key in r and math.isfinite(r[key]):
                    expected.setdefault(tag, {})[r["step"]] = r[key]
    for tag, by_step in expected.items():
        got = events[tag]
        assert [s for s, _ in got] == sorted(by_step), tag          # each step once, in order
        assert [v for _, v in got] == pytest.approx([by_step[s] for s in sorted(by_step)], rel=1e-6), tag
    assert [s for s, _ in events["train/loss"]] == [1, 2, 3, 4, 5]
    assert events["train/loss"][3][1] == pytest.approx(4.0 - 1.2 + 0.05)   # step 4 from the resumed launch
    assert "train/grad_norm" in events and 1 not in [s for s, _ in events["train/grad_norm"]]   # NaN left out
    assert events["events/resumed_step"] == [[2, 2.0]]
    assert events["events/stall_s"] == [[2, pytest.approx(0.01)]]     # the checkpoint event at its step
    assert events["events/steps"] == [[5, 5.0]]      # the first launch's `done` (step 4) was replayed, so purged


def test_without_tensorboardx_a_launch_logs_metrics_and_says_once_how_to_get_events(tmp_path):
    out = python(WRITE, str(tmp_path), tensorboardx=False)
    assert out.count("TensorBoard events: not written") == 2 and "pip install 'ms_llm[report]'" in out
    assert not (tmp_path / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 3, 4, 5]
