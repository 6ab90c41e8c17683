"""The restart policy both launchers share (a real worker crash is in test_checkpoint_resume)."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ms_llm.elastic import check_restarts, with_restarts
from ms_llm.elastic.watch import LaunchWatch, Timeouts
from ms_llm.errors import ConfigError
from ms_llm.job import job_from_dict
from ms_llm.processes import stopped
from ms_llm.run import RunFolder
from ms_llm.run.heartbeat import Heartbeat


def launches(codes: list[int]):
    calls = []

    def start() -> int:
        calls.append(len(calls))
        return codes[len(calls) - 1]
    return start, calls


@pytest.mark.parametrize("codes,max_restarts,rc,starts", [
    ([0], 3, 0, 1),                  # success: never restarted
    ([1, 0], 3, 0, 2),               # one crash, recovered
    ([1, 1, 1], 2, 1, 3),            # gives up after max_restarts, with the last status
    ([7], 0, 7, 1),                  # off by default
])
def test_restarts_until_success_or_the_limit(tmp_path, capsys, codes, max_restarts, rc, starts):
    start, calls = launches(codes)
    assert with_restarts(start, max_restarts, RunFolder(Path(tmp_path))) == rc
    assert len(calls) == starts
    assert capsys.readouterr().err.count("restart ") == starts - 1


def test_restarts_need_checkpoints():
    job = job_from_dict({"name": "j", "model": "tiny", "train": {"checkpoint": {"interval": 0}}})
    with pytest.raises(ConfigError, match="train.checkpoint.interval"):
        check_restarts(job, 1)
    with pytest.raises(ConfigError, match="--max-restarts: got -1"):
        check_restarts(job, -1)
    check_restarts(job, 0)
    check_restarts(job_from_dict({"name": "j", "model": "tiny", "train": {"checkpoint": {"interval": "auto"}}}), 2)


# ---- the supervisor's decisions, without processes (the runs are in test_elastic_faults.py) ----

from ms_llm.backends import check                                   # noqa: E402
from ms_llm.elastic.classify import Failure, deterministic          # noqa: E402
from ms_llm.elastic.watch import Timeouts                           # noqa: E402
from ms_llm.elastic.world import changes, choose_world              # noqa: E402
from ms_llm.errors import CheckpointError, TrainingDiverged         # noqa: E402
from ms_llm.run.heartbeat import failure_cause                      # noqa: E402
from ms_llm.strategy.cost import estimate                           # noqa: E402
from ms_llm.strategy.devices import get_device                      # noqa: E402
from ms_llm.strategy.plan import plan                               # noqa: E402



def backend_runs(job):
    """The check the CLI layer hands the supervisor: the job's backend runs the plan."""
    return lambda p: check(job.backend, p)

def _disk_full() -> CheckpointError:
    err = CheckpointError("step_00000008.tmp: cannot write checkpoint step 8 (No space left on device)")
    err.__cause__ = OSError(28, "No space left on device")
    return err


def test_failure_causes_from_the_exception():
    assert failure_cause(_disk_full()) == "disk_full"
    assert failure_cause(OSError(30, "Read-only file system")) == "read_only"
    assert failure_cause(OSError(5, "Input/output error")) == "io"
    assert failure_cause(TrainingDiverged("loss nan")) == "diverged"
    assert failure_cause(ConfigError("bad")) == "config"
    assert failure_cause(RuntimeError("gloo: connection reset")) == "error"


def test_what_is_retried_and_what_is_not():
    died = Failure("died", (1,), 7, "rank 1 died")
    assert deterministic(died, [], 2) is None
    assert deterministic(Failure("hang", (), 7, "rank 1 stopped"), [died], 2) is None
    full = Failure("exit", (1,), 8, "", {1: ("disk_full", "CheckpointError: ...")})
    assert "disk is full" in deterministic(full, [], 2)
    same = {0: ("error", "RuntimeError: x"), 1: ("error", "RuntimeError: x")}
    assert "every rank" in deterministic(Failure("exit", (0, 1), 3, "", same), [], 2)
    once = Failure("exit", (1,), 5, "", {1: ("error", "RuntimeError: y")})
    assert deterministic(once, [], 2) is None
    assert "same error at step 5" in deterministic(once, [once], 2)
    assert deterministic(Failure("exit", (1,), 6, "", {1: ("error", "RuntimeError: y")}), [once], 2) is None


def test_hang_timeout_from_step_time_with_a_floor_and_an_override():
    assert Timeouts().hang(None) == 30.0
    assert Timeouts().hang(0.5) == 30.0
    assert Timeouts().hang(10.0) == 100.0
    assert Timeouts(hang_s=4.0).hang(10.0) == 4.0


def test_shrink_keeps_tp_and_the_global_batch():
    job = job_from_dict({"name": "j", "model": "tiny", "strategy": {"dp": 4, "tp": 2},
                         "train": {"global_batch_size": 16, "micro_batch_size": 2}})
    p, _ = choose_world(job, job.strategy, 7, 2, backend_runs(job))           # 7 usable ranks: 6 = dp3 does not divide 16
    assert (p.world_size, p.strategy.tp, p.strategy.dp, p.micro_batches) == (4, 2, 2, 4)
    p, _ = choose_world(job, job.strategy, 8, 2, backend_runs(job))
    assert (p.strategy.dp, p.micro_batches) == (4, 2)
    none, reasons = choose_world(job, job.strategy, 3, 4, backend_runs(job))
    assert none is None and reasons


def _running(model: str, device: str, strategy: dict, world: int, **train):
    """A job as the supervisor holds it (resolved for `world`) and its strategy as written."""
    written = job_from_dict({"name": "j", "model": model, "device": device, "strategy": strategy, "train": train})
    resolved = plan(written.model, written.strategy, written.train, world).strategy
    return dataclasses.replace(written, strategy=resolved), written.strategy


def test_shrink_below_tp_asks_the_strategy_search():
    """tp2 x dp2 on 4 ranks: 3 usable keep tp (dp 2 -> 1); 1 usable cannot, the search re-plans."""
    job, written = _running("tiny", "cpu", {"dp": -1, "tp": 2}, 4, global_batch_size=8, micro_batch_size=2)
    p, _ = choose_world(job, written, 3, 1, backend_runs(job))
    assert (p.world_size, p.strategy.tp, changes(job, p)) == (2, 2, "dp 2 -> 1, mb 2 -> 4")
    p, _ = choose_world(job, written, 1, 1, backend_runs(job))
    assert (p.world_size, p.strategy.tp, p.train.global_batch_size) == (1, 1, 8)
    assert "tp 2 -> 1" in changes(job, p)


def test_shrink_that_runs_out_of_memory_is_re_planned_to_fit():
    """A 7B model, plain DDP on 8 H100s, 4 left: dp4 alone needs more than 80 GB per device (the
    reason is kept); the search's plan for 4 shards what must be sharded and fits."""
    job, written = _running("llama2_7b", "h100", {"dp": -1}, 8, global_batch_size=64, micro_batch_size=1,
                            seq_len=4096)
    p, reasons = choose_world(job, written, 4, 1, backend_runs(job))
    device = get_device("h100")
    assert p.world_size == 4 and p.train.global_batch_size == 64
    assert estimate(p, device).memory.total <= device.memory_bytes
    assert reasons[0].startswith("4 rank(s) with tp/pp/cp kept: needs") and "more than the 80 GB" in reasons[0]
    assert set(changes(job, p).split(", ")) - {"dp 8 -> 4", "mb 8 -> 16"}        # more than dp changed
    none, reasons = choose_world(job, written, 1, 1, backend_runs(job))
    assert none is None and "the strategy search found no plan that fits a h100" in reasons[-1]


@pytest.mark.parametrize("flags,line", [
    (["--min-ranks", "2"], "--min-ranks: only used with --elastic"),
    (["--elastic", "--min-ranks", "0"], "--min-ranks: got 0"),
    (["--elastic", "--hang-timeout", "-1"], "--hang-timeout: got -1.0"),
])
def test_elastic_flags_are_checked_one_line_each(tmp_path, capsys, flags, line):
    from ms_llm.cli import main
    assert main(["train", str(tmp_path / "job.yaml"), *flags]) != 0
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err


def test_a_recovery_counts_ranks_that_stepped_then_failed(tmp_path):
    """A launch resumed from step 4 has recovered once every rank completed a step in it, even
    when the supervisor next looks only after a peer's death turned a rank's record to "failed";
    a rank that failed before any new step has not."""
    watch = LaunchWatch(tmp_path, range(2), time.time(), Timeouts())
    beats = [Heartbeat(tmp_path, rank) for rank in range(2)]
    for beat in beats:
        beat.beat(4, phase="start")
    watch.current()
    assert not watch.first_new_step(4)
    beats[0].beat(5)
    beats[1].fail(4, ConnectionResetError("peer closed"))
    watch.current()
    assert not watch.first_new_step(4)
    beats[0].beat(11)
    beats[1].fail(11, ConnectionResetError("peer closed"))
    watch.current()
    assert watch.first_new_step(4)


def _beats(folder: Path, beats: dict[int, tuple[int, int, float]]) -> None:
    """Heartbeat files as workers write them: rank -> (pid, step, seconds since its last beat)."""
    folder.mkdir(exist_ok=True)
    for rank, (pid, step, age) in beats.items():
        (folder / f"rank_{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "pid": pid, "host": "n0", "step": step, "phase": "train", "time": time.time() - age}))


def test_a_hang_names_the_rank_whose_heartbeat_stopped_not_the_one_that_waited(tmp_path):
    """The waiting rank's heartbeat stops too and may pass the timeout first: the report still names
    the rank that holds it up, a step behind or a stopped process."""
    timeouts, me = Timeouts(hang_s=4.0), os.getpid()
    _beats(tmp_path / "behind", {0: (me, 6, 4.5), 1: (me, 5, 3.9)})
    watch = LaunchWatch(tmp_path / "behind", range(2), time.time() - 60, timeouts)
    failure = watch.poll()
    assert (failure.kind, failure.ranks) == ("hang", (1,))
    assert re.fullmatch(r"rank 1's heartbeat stopped after step 5, \d\.\d s ago: it holds the others up; rank 0 "
                        r"made no progress after step 6 for \d\.\d s \(timeout 4\.0 s\), waiting for rank 1",
                        failure.detail), failure.detail
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        while not stopped(sleeper.pid):
            time.sleep(0.01)
        _beats(tmp_path / "stopped", {0: (me, 5, 4.5), 1: (sleeper.pid, 5, 3.8)})
        failure = LaunchWatch(tmp_path / "stopped", range(2), time.time() - 60, timeouts).poll()
        assert failure.ranks == (1,)
        assert re.match(r"rank 1's heartbeat stopped after step 5, \d\.\d s ago \(the process is stopped\)",
                        failure.detail), failure.detail
    finally:
        sleeper.kill()
        sleeper.wait()
    _beats(tmp_path / "even", {0: (me, 5, 4.5), 1: (me, 5, 3.8)})     # nothing tells them apart: the late one
    failure = LaunchWatch(tmp_path / "even", range(2), time.time() - 60, timeouts).poll()
    assert failure.ranks == ()
    assert re.fullmatch(r"rank 0 made no progress after step 5 for \d\.\d s \(timeout 4\.0 s\)", failure.detail)
