"""Faults of a run folder: a torn metrics.jsonl (a writer killed mid-line, a full disk), read by
every reader and appended to by rank 0 and the elastic supervisor; two jobs in one folder."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ms_llm.data import build_stdlib_corpus
from ms_llm.errors import RunFolderError
from ms_llm.mindspore.launch import _follow
from ms_llm.processes import alive, descendants, kill_all
from ms_llm.run import RunFolder
from ms_llm.run.folder import RunLock
from ms_llm.run.heartbeat import read_heartbeats
from ms_llm.run.memory_tier import MemoryTier
from ms_llm.run.metrics import (MetricsLogger, StepMetrics, append_record, read_metrics, read_records,
                                run_summary, whole_end)

ROOT = Path(__file__).resolve().parents[2]
TORN = b'{"step": 3, "loss": 2.5, "l'


def _step(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": 0.0, "memory_gb": 0.0}


def _lines(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def test_readers_leave_out_a_torn_last_line_and_start_at_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines([_step(1, 3.0), _step(2, 2.8)]) + TORN)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    end = whole_end(path)
    assert end == len(_lines([_step(1, 3.0), _step(2, 2.8)]))
    assert read_records(path, end) == ([], end)
    # the launcher's offset from before a restart: rank 0 drops the torn tail, then appends
    logger = MetricsLogger(path, total_steps=4, every=1, stream=open("/dev/null", "w"))
    logger.log(StepMetrics(step=3, loss=2.5, lr=1e-3, tokens_per_s=1.0, mfu=0.0, memory_gb=0.0))
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert run_summary(path, end).startswith("done: steps 3-3, loss 2.5000 -> 2.5000")
    # an offset inside a record (a size taken with the torn tail) skips that record's rest, no error
    assert run_summary(path, end + 5) == ""


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines([_step(1, 3.0)]) + TORN)
    append_record(path, {"event": "failure", "ranks": [1]})
    append_record(path, {"event": "recovered", "recovery_s": 1.5})
    assert path.read_bytes().count(b"\n") == 4
    assert read_metrics(path) == [_step(1, 3.0), {"event": "failure", "ranks": [1]},
                                  {"event": "recovered", "recovery_s": 1.5}]


def test_the_progress_follower_prints_the_steps_written_after_a_torn_tail(tmp_path, capsys):
    """msrun's progress follower: started on a torn file, while a 'worker' drops the torn tail and
    appends two steps; it prints both and ends without a JSONDecodeError."""
    run = RunFolder.create("torn", tmp_path / "run")
    run.metrics.write_bytes(_lines([_step(1, 3.0), _step(2, 2.8)]) + TORN)
    writer = ("import sys\nfrom ms_llm.run.metrics import MetricsLogger, StepMetrics\n"
              "log = MetricsLogger(sys.argv[1], 4, 1, stream=sys.stderr)\n"
              "for s in (3, 4):\n"
              "    log.log(StepMetrics(step=s, loss=3.0 - s / 4, lr=1e-3, tokens_per_s=1.0, mfu=0.0, memory_gb=0.0))\n"
              "log.close()\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(run.metrics)], cwd=ROOT)
    _follow(run, proc, total=4, every=1, gate=None)
    assert proc.wait(timeout=60) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split()[1] for line in out] == ["3/4", "4/4"]


def _torch_job(tmp: Path, steps: int, interval: int, backend: str = "torch", memory_tier: bool = False) -> Path:
    tokens = build_stdlib_corpus(tmp / "corpus")
    model = dict(name="faults", vocab_size=264, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                 ffn_hidden_size=32, max_seq_len=16, dtype="float32")
    job = {"name": "faults", "backend": backend, "device": "cpu", "model": model,
           "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 2, "micro_batch_size": 2, "seq_len": 8, "steps": steps, "seed": 3,
                     "log_every": 1, "optimizer": {"name": "adamw", "lr": 1e-3},
                     "schedule": {"warmup_steps": 1, "decay": "constant"}, "data": {"source": str(tokens)},
                     "checkpoint": {"interval": interval, "memory_tier": memory_tier}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train(config: Path, run: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                           "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_resume_after_a_torn_metrics_tail_exits_0_with_every_record_whole(tmp_path):
    config, run = _torch_job(tmp_path, steps=2, interval=2), tmp_path / "run"
    first = _train(config, run, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(TORN)
    again = _train(config, run, 4)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "done: steps 3-4" in again.stdout
    data = (run / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n") and TORN not in data
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]


def _wait_training(run: Path, proc: subprocess.Popen, timeout_s: float = 180) -> dict:
    """The first job's rank 0 once it reports a step (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        beat = read_heartbeats(run / "heartbeat").get(0)
        if beat and beat["phase"] == "train":
            return beat
        time.sleep(0.2)
    raise AssertionError(f"the first job did not reach a step (exit {proc.poll()})")


def _stop(proc: subprocess.Popen) -> None:
    assert kill_all([proc.pid, *descendants(proc.pid)]) == []
    proc.wait(timeout=30)


def _files(run: Path) -> list[Path]:
    """The run folder's files but those the running job adds as it goes (heartbeats, TensorBoard
    events, torchrun's and the compilers' temporary files)."""
    going = {"heartbeat", "tensorboard", "tmp"}
    return sorted(q for q in (p.relative_to(run) for p in run.rglob("*")) if not going & set(q.parts))


@pytest.mark.slow
def test_a_second_job_in_a_held_run_folder_names_the_holder_and_touches_nothing(tmp_path):
    config, run = _torch_job(tmp_path, steps=100_000, interval=100_000), tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_training(run, first)
        config_stat = (run / "config.yaml").stat()
        files = _files(run)
        for flags in ((), ("--elastic",)):
            second = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                                     *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            line, = second.stderr.splitlines()
            assert f"is in use by pid {first.pid} on host {socket.gethostname()} since " in line, line
            assert "ms-llm train: error: run folder" in line and second.stdout == ""
        assert (run / "config.yaml").stat().st_mtime_ns == config_stat.st_mtime_ns
        assert _files(run) == files, set(_files(run)) ^ set(files)
        assert first.poll() is None
    finally:
        _stop(first)


def test_the_lock_of_a_killed_job_is_released_by_the_kernel(tmp_path):
    run = RunFolder.create("lock", tmp_path / "run")
    holder = ("import sys, time\nfrom ms_llm.run import RunFolder\nfrom ms_llm.run.folder import RunLock\n"
              "RunLock(RunFolder(__import__('pathlib').Path(sys.argv[1]))).acquire()\n"
              "print('held', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run.root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(RunFolderError, match=f"in use by pid {proc.pid} on host "):
            RunLock(run).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with RunLock(run) as lock:                     # no stale lock: the holder is gone
        assert json.loads((run.root / ".lock.node0").read_text())["pid"] == os.getpid()
    assert lock.fd is None
    with RunLock(run, node_rank=1), RunLock(run, node_rank=0):     # the nodes of one job lock apart
        pass


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_workers_of_a_killed_plain_launcher_exit_within_seconds(tmp_path, backend):
    """kill -9 of `ms-llm train` (no --elastic): torchrun or msrun gets SIGTERM from the kernel
    and every worker sees its launcher gone; nothing is left running, orphaned."""
    config, run = _torch_job(tmp_path, steps=100_000, interval=100_000, backend=backend), tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker = _wait_training(run, launcher)["pid"]
        below = descendants(launcher.pid)
        assert worker in below and len(below) >= 2              # torchrun or msrun, and the worker
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in below):
        time.sleep(0.1)
    left = [p for p in below if alive(p)]
    kill_all(left)
    assert left == []


@pytest.mark.slow
def test_the_memory_tier_of_a_killed_elastic_launcher_is_freed_within_seconds(tmp_path):
    """--elastic with memory_tier: true, then kill -9 of `ms-llm train` (the supervisor: nothing
    of it runs to clean up). The snapshot keeper, detached from the workers so that it outlives a
    crashed trainer, sees its launcher gone and removes the tier from /dev/shm at once (it used
    to keep it for the hour of its ttl). The keeper is the same for both backends: torch shows it."""
    config, run = _torch_job(tmp_path, steps=100_000, interval=1, memory_tier=True), tmp_path / "run"
    tier = MemoryTier.for_run("faults", run)
    launcher = subprocess.Popen([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                                 "--elastic"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_training(run, launcher)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None and tier.latest() is None:
            time.sleep(0.1)                         # a snapshot in /dev/shm, its keeper holding it
        keeper = tier.keeper_pid()
        assert tier.latest() is not None and keeper is not None and alive(keeper)
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    killed = time.monotonic()
    while time.monotonic() < killed + 10 and (alive(keeper) or tier.root.exists()):
        time.sleep(0.05)
    left = [keeper] if alive(keeper) else []
    kill_all(left)
    tier.release()
    assert left == [] and not tier.root.exists(), f"after {time.monotonic() - killed:.1f} s"


TORCHRUN_REPORT = """\
W1128 09:49:21.100000 13510 api.py:900] Sending process 13518 closing signal SIGTERM
E1128 09:49:21.200000 13510 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 13519) of binary: py
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  time      : 2026-11-28_09:49:21
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 13518)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 13518
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_09:49:21
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 13519)
  error_file: <N/A>
============================================================
"""


def test_a_failed_launch_is_told_in_one_line_per_rank(tmp_path):
    """What replaces the backend launcher's report on the console: each failed rank's exit (from
    torchrun's report, or msrun's line matched to the rank by pid) and the error it recorded, if
    this launch recorded one."""
    from torch_backend.launch import exits, torchrun_report
    from ms_llm.mindspore.launch import msrun_exits
    from ms_llm.run.heartbeat import Heartbeat, failure_lines

    report = TORCHRUN_REPORT.splitlines(keepends=True)
    assert [torchrun_report(line) for line in report[:4]] == [True, True, True, False]
    assert not torchrun_report("[rank0]:Traceback (most recent call last):\n")     # a worker's own output
    assert exits(report) == {2: -15, 3: 1}

    run = RunFolder.create("lines", tmp_path / "run")
    since = time.time()
    run.heartbeat.mkdir()
    (run.heartbeat / "rank_00000.json").write_text(json.dumps(      # an earlier launch's failure: not this one's
        {"rank": 0, "pid": 1, "step": 3, "phase": "failed", "time": since - 60, "error": "ValueError: earlier"}))
    Heartbeat(run.heartbeat, 3).fail(7, RunFolderError("run folder X: cannot write (No space left on device)"))
    assert failure_lines(run.heartbeat, since, exits(report)) == [
        "rank 2 was killed by SIGTERM",
        "rank 3 exited with 1 after step 7: RunFolderError: run folder X: cannot write (No space left on device)"]
    assert failure_lines(run.heartbeat, since, {1: 2}) == [
        "rank 1 exited with 2 (no error recorded)",
        "rank 3 failed after step 7: RunFolderError: run folder X: cannot write (No space left on device)"]

    run.launcher_log.write_text("earlier launch: Worker process 1 exit with exception. Error code: 9.\n")
    offset = run.launcher_log.stat().st_size
    pid = read_heartbeats(run.heartbeat)[3]["pid"]
    with open(run.launcher_log, "a") as log:
        log.write(f"[ERROR] ME(1:2,MainProcess):[_api.py:365] Worker process {pid} exit with exception. "
                  "Error code: 1.\n"
                  "[ERROR] ME: Worker process 999999999 exit with exception. Error code: -9.\n")    # no heartbeat
    assert msrun_exits(run, offset) == {3: 1}
