"""Fault injection under `ms-llm train --elastic` (torch, gloo, real torchrun; MindSpore where
marked): kill -9 of a random rank at a random step, a stopped rank, a shrink 2 -> 1 and a grow
1 -> 2 with the loss curve continuing the uninterrupted run's, a disk that fills during a
checkpoint (with and without --elastic), and more failures than --max-restarts. Every random
choice comes from a fixed seed."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.storage.commit import latest
from ms_llm.data import build_stdlib_corpus
from ms_llm.run.heartbeat import read_heartbeats
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(name="elastic", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, dtype="float32")
STEPS, INTERVAL = 28, 4


def _job(tmp: Path, tokens: Path, keep_last: int = 20) -> Path:
    job = {"name": "elastic", "backend": "torch", "device": "cpu", "model": MODEL,
           "strategy": {"dp": -1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                     "log_every": 1, "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.01},
                     "schedule": {"warmup_steps": 2, "decay": "constant"}, "data": {"source": str(tokens)},
                     "checkpoint": {"interval": INTERVAL, "keep_last": keep_last}}}
    path = tmp / f"job-{keep_last}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _cmd(config: Path, run: Path, nproc: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run), "--nproc", str(nproc),
            "--steps", str(STEPS), *flags]


def _losses(run: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in read_metrics(run / "metrics.jsonl"):
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def _events(run: Path, event: str) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == event]


def _params(run: Path) -> dict[str, np.ndarray]:
    with Checkpoint(latest(run / "checkpoints")) as ckpt:
        assert ckpt.step == STEPS
        return {n: ckpt.read_full(n) for n in ckpt.names() if n.startswith("model.") or n == "lm_head.weight"}


class Chaos:
    """Signals a rank once it reports a step, from a fresh launch each time (a pid not yet hit)."""

    def __init__(self, run: Path, proc: subprocess.Popen):
        self.run, self.proc, self.hit = run, proc, []

    def strike(self, rank: int, at_step: int, sig: int = signal.SIGKILL, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            beat = read_heartbeats(self.run / "heartbeat").get(rank)
            if beat and beat["phase"] == "train" and beat["step"] >= at_step and beat["pid"] not in self.hit:
                os.kill(beat["pid"], sig)
                self.hit.append(beat["pid"])
                return beat
            time.sleep(0.01)
        raise AssertionError(f"rank {rank} never reached step {at_step} in a new launch")


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _on_the_curve(run: Path, ref: dict[int, list[float]]) -> None:
    """Every step ran, and every loss (repeated steps too) is the uninterrupted run's."""
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, values in losses.items():
        for v in values:
            assert v == pytest.approx(ref[step][0], abs=1e-5), step


def _no_workers_left(run: Path) -> None:
    for beat in read_heartbeats(run / "heartbeat").values():
        stat = Path(f"/proc/{beat['pid']}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX", beat


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A folder for the module's runs and the token file they read."""
    tmp = tmp_path_factory.mktemp("elastic")
    return tmp, build_stdlib_corpus(tmp / "data", max_bytes=200_000)


@pytest.fixture(scope="module")
def reference(corpus):
    """The uninterrupted run on 2 ranks."""
    tmp, tokens = corpus
    config = _job(tmp, tokens)
    run = tmp / "ref"
    out = _finish(_start(_cmd(config, run, 2)))
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir(), out[-3000:]
    return tmp, tokens, config, _losses(run), _params(run)


@pytest.mark.slow
def test_kill_a_random_rank_at_a_random_step_five_times(reference):
    """Five kill -9 trials in one job: each relaunch resumes from the newest checkpoint and the
    final parameters are bit-equal to the uninterrupted run's."""
    tmp, _, config, _, want = reference
    run, rng = tmp / "kills", random.Random(16)
    proc = _start(_cmd(config, run, 2, "--elastic", "--max-restarts", "5"))
    chaos = Chaos(run, proc)
    at = 0
    for _ in range(5):
        at = rng.randint(at + 1, at + 6)
        chaos.strike(rng.randrange(2), at)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    failures, recovered = _events(run, "failure"), _events(run, "recovered")
    assert [f["kind"] for f in failures] == ["died"] * 5, failures
    assert len(recovered) == 5 and all(r["recovery_s"] > 0 for r in recovered)
    got = _params(run)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    _no_workers_left(run)


@pytest.mark.slow
def test_shrink_on_failure_then_grow_when_capacity_returns(reference):
    """2 ranks; the node declares 1 usable and a rank dies: the supervisor shrinks dp 2 -> 1
    (4 micro-batches, the same global batch); the node declares 2 again: it grows back at the
    next checkpoint. Every loss equals the uninterrupted run's."""
    tmp, _, config, ref, _ = reference
    run = tmp / "resize"
    (run / "elastic").mkdir(parents=True)
    capacity = run / "elastic" / "capacity.node0"
    proc = _start(_cmd(config, run, 2, "--elastic", "--max-restarts", "1"))
    chaos = Chaos(run, proc)
    capacity.write_text("1")
    chaos.strike(1, 6)
    while proc.poll() is None and not _events(run, "recovered"):
        time.sleep(0.05)
    capacity.write_text("2")
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    worlds = [(w["reason"], w["world"], w["micro_batches"]) for w in _events(run, "world")]
    assert worlds == [("shrink", 1, 4), ("grow", 2, 2)], worlds
    _on_the_curve(run, ref)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_stopped_rank_is_detected_then_too_many_failures_stop_with_a_report(reference, backend):
    """SIGSTOP: the rank's heartbeat stops, the supervisor kills every worker (the stopped one
    too) and resumes. A second failure exceeds --max-restarts 1: the job stops with a report
    and every checkpoint on disk loads. On MindSpore (CPU: HCCL_EXEC_TIMEOUT is Ascend's) the
    stopped rank's peer waits in its all-reduce until the supervisor's hang detection stops both."""
    tmp, tokens, config, _, _ = reference
    config = _ms_job(tmp, tokens) if backend == "mindspore" else config
    run = tmp / f"stop-{backend}"
    proc = _start(_cmd(config, run, 2, "--elastic", "--max-restarts", "1", "--hang-timeout", "4"))
    chaos = Chaos(run, proc)
    chaos.strike(1, 5, signal.SIGSTOP)
    chaos.strike(0, 8)
    out = _finish(proc)
    assert proc.returncode == 1, out[-4000:]
    assert [f["kind"] for f in _events(run, "failure")] == ["hang", "died"]
    assert "process is stopped" in _events(run, "failure")[0]["detail"]
    assert len(_events(run, "recovered")) == 1
    report = json.loads((run / "elastic" / "report.node0.json").read_text())
    assert "more than --max-restarts 1" in report["cause"] and len(report["failures"]) == 2
    assert report["checkpoints"]
    for name in report["checkpoints"]:
        with Checkpoint(run / "checkpoints" / name) as ckpt:
            ckpt.verify()
    _no_workers_left(run)


@pytest.mark.slow
def test_a_killed_supervisor_leaves_no_process_behind(reference):
    """SIGKILL of the supervisor itself (nothing of it runs to clean up): torchrun dies with it
    (PR_SET_PDEATHSIG), and every worker, the standby's waiting at their gate too, exits on its own."""
    from ms_llm.processes import alive, descendants

    tmp, _, config, _, _ = reference
    run = tmp / "orphans"
    proc = _start(_cmd(config, run, 2, "--elastic", "--steps", "100000"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        standby = [p for p in (run / "elastic").glob("gate.*.waiting.*")] if (run / "elastic").is_dir() else []
        if len(standby) == 2 and read_heartbeats(run / "heartbeat").get(0, {}).get("step", 0) >= 3:
            break
        time.sleep(0.05)
    below = descendants(proc.pid)
    workers = {b["pid"] for b in read_heartbeats(run / "heartbeat").values()}
    assert workers <= set(below) and len(below) >= 6, below      # 2 launchers, 2 + 2 workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(p) for p in below):
        time.sleep(0.1)
    assert not [p for p in below if alive(p)]


VERIFY = ("import sys; from ms_llm.checkpoint.storage.commit import latest; from ms_llm.checkpoint.reader import Checkpoint; "
          "c = Checkpoint(latest(sys.argv[1])); c.verify(); print('latest intact: step', c.step)")


def _in_small_tmpfs(run: Path, size: str, cmd: list[str]) -> list[str]:
    """`cmd` in a mount namespace of its own with `run` a tmpfs of `size` (gone with the namespace),
    then a check there that the checkpoint `latest` names loads."""
    inner = (f"mount -t tmpfs -o size={size} tmpfs {run} || exit 9; \"$@\"; rc=$?; "
             f"{sys.executable} -c \"{VERIFY}\" {run}/checkpoints; exit $rc")
    userns = [] if os.geteuid() == 0 else ["-r"]
    return ["unshare", *userns, "-m", "--propagation", "private", "sh", "-c", inner, "sh", *cmd]


def _tiny_job(tmp: Path, tokens: Path, backend: str) -> Path:
    """The smallest model, a checkpoint (about 0.2 MB) after every step: a small disk fills in a few."""
    model = dict(name="full", vocab_size=264, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                 ffn_hidden_size=32, max_seq_len=16, dtype="float32")
    job = {"name": "full", "backend": backend, "device": "cpu", "model": model,
           "strategy": {"dp": -1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 8, "steps": 40, "seed": 3,
                     "log_every": 1, "optimizer": {"name": "adamw", "lr": 1e-3},
                     "schedule": {"warmup_steps": 1, "decay": "constant"}, "data": {"source": str(tokens)},
                     "checkpoint": {"interval": 1, "keep_last": 1000}}}
    path = tmp / f"tiny-{backend}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.parametrize("backend, size", [("torch", "1m"), ("mindspore", "2m")])    # MindSpore's graphs take 1.3 MB
def test_disk_full_stops_with_one_line_naming_the_disk(corpus, backend, size, elastic):
    """A run folder that fills up a few checkpoints in. The workers' logs, heartbeats and error
    files are on the full disk, so the launcher (plain) or the supervisor (--elastic, which does not
    retry: the cause is deterministic) looks at the folder itself. The last line names the folder,
    the bytes free and the bytes a checkpoint needs; the backend launcher's own report (torchrun's
    ChildFailedError traceback, msrun's, the workers' tails) stays off the console, which gets a line
    per failed rank instead; neither launcher restarts (--max-restarts 2); the checkpoint `latest`
    names, saved before, still loads."""
    tmp, tokens = corpus
    run = tmp / f"full-{backend}-{'elastic' if elastic else 'plain'}"
    run.mkdir()
    cmd = [sys.executable, "-m", "ms_llm", "train", str(_tiny_job(tmp, tokens, backend)), "--run-dir", str(run),
           "--nproc", "2", "--max-restarts", "2", *(["--elastic"] if elastic else [])]
    out = _finish(_start(_in_small_tmpfs(run, size, cmd)))
    lines = out.splitlines()
    assert lines[-1].startswith("latest intact: step") and lines[-1] != "latest intact: step 0", out[-3000:]
    assert lines[-2].startswith(f"ms-llm train: workers failed (exit 1): the disk is full: {run} has "), out[-3000:]
    assert "bytes free (counting partial saves), a checkpoint needs" in lines[-2]
    assert "Traceback" not in out, out[-3000:]
    if elastic:
        assert "ms-llm elastic: stopped: not retried: the disk is full" in out, out[-3000:]
        assert out.count("ms-llm elastic: failure") == 1, out[-3000:]
    else:
        assert "restart 1 of 2" not in out, out[-3000:]          # a restart would fill the same disk
    if not elastic and backend == "torch":  # torchrun's report, held in memory, names both ranks' exits
        assert [line.split()[3] for line in lines if line.startswith("ms-llm train: rank ")] == ["0", "1"], out[-3000:]


WRITE = """
import sys
import numpy as np
from ms_llm.checkpoint.shards import Piece
from ms_llm.checkpoint.storage.boxes import Region
from ms_llm.checkpoint.writer import CheckpointWriter, SaveItem
from ms_llm.errors import CheckpointError
w = CheckpointWriter(sys.argv[1], 0, 1)
data = np.ones((512, 1024), np.float32)                                  # 2 MiB: more than the 1 MiB tmpfs
w.save(1, [SaveItem(Piece("w", data.shape, Region((0, 0), data.shape)), data)])
try:
    w.wait()
except CheckpointError as exc:
    print("ERROR", exc)
"""


def test_a_checkpoint_write_on_a_full_disk_names_the_folder_and_the_bytes(tmp_path):
    """ENOSPC from a real (1 MiB tmpfs) file system: one clear error, raised, not a hang."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    proc = subprocess.run(_in_small_tmpfs(folder, "1m", [sys.executable, "-c", WRITE, str(folder)]),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("ERROR")]
    assert line, proc.stdout + proc.stderr
    assert "step_00000001.tmp: cannot write checkpoint step 1 (No space left on device)" in line[0]
    assert "rank 0 needs 2,097,280 bytes there, 0 bytes free" in line[0]          # 2 MiB + the header


@pytest.mark.slow
def test_two_nodes_lose_one_and_the_other_shrinks_and_continues(reference):
    """Two supervisors as two nodes over 127.0.0.1 (one rank each, torchrun's static rendezvous).
    Node 1 is killed entirely (its supervisor, torchrun and worker): node 0 finds its peer gone,
    shrinks to one rank with 4 micro-batches and finishes on the uninterrupted loss curve."""
    from ms_llm.processes import descendants, kill_all
    from ms_llm.nodes import free_port

    tmp, _, config, ref, _ = reference
    run, port = tmp / "nodes", free_port()
    nodes = [_start(_cmd(config, run, 2, "--elastic", "--max-restarts", "1", "--nnodes", "2", "--node-rank", str(r),
                         "--master-addr", "127.0.0.1", "--master-port", str(port))) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and nodes[0].poll() is None:
            beat = read_heartbeats(run / "heartbeat").get(1)
            if beat and beat["phase"] == "train" and beat["step"] >= 6:
                break
            time.sleep(0.01)
        assert not kill_all([nodes[1].pid, *descendants(nodes[1].pid)])
        nodes[1].communicate()
        out = _finish(nodes[0])
    finally:
        for proc in nodes:
            if proc.poll() is None:
                kill_all([proc.pid, *descendants(proc.pid)])
    assert nodes[0].returncode == 0, out[-4000:]
    assert "1 node(s) gone: 1 left" in out
    assert [(w["reason"], w["world"], w["micro_batches"]) for w in _events(run, "world")] == [("shrink", 1, 4)]
    _on_the_curve(run, ref)


def _ms_job(tmp: Path, tokens: Path) -> Path:
    job = yaml.safe_load(_job(tmp, tokens).read_text())
    job["backend"] = "mindspore"
    config = tmp / "ms.yaml"
    config.write_text(yaml.safe_dump(job))
    return config


@pytest.mark.slow
def test_mindspore_kill_a_rank_resumes_sample_exact(reference):
    """msrun under the supervisor, its standby msrun waiting at the gate: kill -9 of a MindSpore
    worker is seen at once (not after msrun's scheduler times out), every process is stopped, the
    standby opens, loads its graphs from the compile cache the first launch wrote and resumes from
    the checkpoint; each repeated step has the loss it had the first time. Then SIGKILL of the
    supervisor: every process below it goes too."""
    from ms_llm.processes import alive, descendants

    tmp, tokens, _, _, _ = reference
    run = tmp / "ms"
    with open(tmp / "ms.log", "w") as log:              # an endless run: its output to a file, not a pipe
        proc = subprocess.Popen(_cmd(_ms_job(tmp, tokens), run, 2, "--elastic", "--steps", "100000"), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and len(list(run.glob("elastic/*.waiting.*"))) < 3:
            time.sleep(0.05)                            # 2 workers and msrun's scheduler at the gate
        now = read_heartbeats(run / "heartbeat")[1]["step"] + 2
        hit = Chaos(run, proc).strike(1, now + (2 - now) % INTERVAL)   # 2 steps past a checkpoint: steps to redo
        while time.monotonic() < deadline and proc.poll() is None and not (_events(run, "recovered") and any(
                len(v) > 1 and k >= hit["step"] - 1 for k, v in _losses(run).items())):
            time.sleep(0.05)                            # until the relaunch has run the steps again
        below = descendants(proc.pid)
        proc.kill()
        proc.wait()
        gone = time.monotonic() + 60
        while time.monotonic() < gone and any(alive(p) for p in below):
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [p for p in below if alive(p)], "processes outlived the supervisor"     # msrun's log tails too
    out = (tmp / "ms.log").read_text()
    assert [f["kind"] for f in _events(run, "failure")] == ["died"], out[-4000:]
    assert len(_events(run, "recovered")) == 1, out[-4000:]
    losses = _losses(run)
    repeated = sorted(k for k, v in losses.items() if len(v) > 1)
    resumed = [r["resumed_step"] for r in read_metrics(run / "metrics.jsonl") if "resumed_step" in r]
    # Rank 1 finished step k only after rank 0 had logged step k - 1 (rank 0 may not have logged k itself).
    assert resumed[0] % INTERVAL == 0 and repeated[0] == resumed[0] + 1 and repeated[-1] >= hit["step"] - 1
    for k in repeated:
        assert losses[k][0] == pytest.approx(losses[k][1], abs=1e-6), k
    keys = list((run / "compile_cache").iterdir())
    cached = [f for f in keys[0].glob("rank_*/graph_cache/*.mindir")]
    assert len(keys) == 1 and {f.parts[-3] for f in cached} == {"rank_0", "rank_1"}
    failed_at = _events(run, "failure")[0]["time"]
    assert all(f.stat().st_mtime < failed_at for f in cached), "the relaunch compiled again"
    _no_workers_left(run)


@pytest.mark.slow
def test_mindspore_shrinks_dp2_to_dp1_on_a_failure(reference):
    """MindSpore dp2; the node declares one usable rank and a worker dies: the supervisor relaunches
    msrun on one rank with 4 micro-batches (the same global batch), which resumes from the dp2
    checkpoint; every step run again has the loss it had at dp2."""
    tmp, tokens, _, _, _ = reference
    run = tmp / "ms-shrink"
    (run / "elastic").mkdir(parents=True)
    (run / "elastic" / "capacity.node0").write_text("1")
    proc = _start(_cmd(_ms_job(tmp, tokens), run, 2, "--elastic", "--max-restarts", "1", "--steps", "12"))
    hit = Chaos(run, proc).strike(1, 10)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert [(w["reason"], w["world"], w["micro_batches"]) for w in _events(run, "world")] == [("shrink", 1, 4)]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 13))
    resumed = [r["resumed_step"] for r in read_metrics(run / "metrics.jsonl") if "resumed_step" in r]
    repeated = sorted(k for k, v in losses.items() if len(v) > 1)
    # Rank 1 finished step k only after rank 0 had logged step k - 1 (rank 0 may not have logged k itself).
    assert resumed == [8] and repeated == list(range(9, repeated[-1] + 1)) and repeated[-1] >= hit["step"] - 1, (
        resumed, repeated)
    for k in repeated:
        assert losses[k][1] == pytest.approx(losses[k][0], abs=1e-5), k
    _no_workers_left(run)


@pytest.mark.slow
def test_mindspore_collective_on_cpu_times_out_like_torch(corpus):
    """A plain MindSpore launch (no supervisor) with rank 1 stopped: rank 0's all-reduce fails after
    the launch's collective timeout (MS_LLM_COLLECTIVE_TIMEOUT_S, 5 s here, which the launcher gives
    MindSpore's CPU ring all-reduce as MS_CPU_COMM_OP_TIMEOUT; MindSpore's own default is 30 s, torch
    has the same bound through gloo). The launch ends with a line naming rank 0's error, no hang."""
    tmp, tokens = corpus
    run = tmp / "ms-collective"
    cmd = [sys.executable, "-m", "ms_llm", "train", str(_tiny_job(tmp, tokens, "mindspore")), "--run-dir", str(run),
           "--nproc", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, MS_LLM_COLLECTIVE_TIMEOUT_S="5"))
    stopped = Chaos(run, proc).strike(1, 3, signal.SIGSTOP)
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]
    waiter = read_heartbeats(run / "heartbeat")[0]
    assert waiter["phase"] == "failed" and "AllReduce" in waiter["error"], waiter
    assert 5 <= waiter["time"] - stopped["time"] < 25, (waiter, stopped)       # the failure recorded ~3 s after
    line = f"ms-llm train: workers failed (exit 1): {waiter['error']}"
    assert out.splitlines()[-1].startswith(line) and "Traceback" not in out, out[-3000:]
    _no_workers_left(run)
