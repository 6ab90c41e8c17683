"""`ms-llm clean RUN_DIR`: the run's memory tier and its keeper are gone, half-written
checkpoints removed, committed ones kept."""
from __future__ import annotations

import time
import uuid

from ms_llm.cli import main
from ms_llm.run.folder import RunFolder, RunLock
from ms_llm.run.memory_tier import MemoryTier


def _alive(pid: int) -> bool:
    """Running (a keeper started by this process stays a zombie until reaped: not alive)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_clean_stops_the_keeper_and_removes_leftovers(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000020.tmp").mkdir()
    name = f"clean-test-{uuid.uuid4().hex[:8]}"
    (run / "config.yaml").write_text(f"name: {name}\n")
    tier = MemoryTier.for_run(name, run, ttl_s=600)
    tier.attach(0, 1)
    pid = tier.keeper_pid()
    assert pid and _alive(pid)
    assert main(["clean", str(run)]) == 0
    assert str(tier.root) in capsys.readouterr().out
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and not tier.root.exists()
    assert not tier.root.parent.exists() or any(tier.root.parent.iterdir())   # no empty base folder left
    assert (run / "checkpoints" / "step_00000010").is_dir() and not (run / "checkpoints" / "step_00000020.tmp").exists()
    assert main(["clean", str(run)]) == 0
    assert "left nothing behind" in capsys.readouterr().out


def test_clean_names_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["clean", str(tmp_path)]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_clean_refuses_a_run_folder_a_job_holds(tmp_path, capsys):
    """A running job's half-written checkpoint is the one it is saving: clean leaves it alone and
    names the holder; once the job is gone it cleans."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000020.tmp").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: clean-held-{uuid.uuid4().hex[:8]}\n")
    with RunLock(RunFolder(run), 1):
        assert main(["clean", str(run)]) == 2
        err = capsys.readouterr().err
        assert "is in use by pid" in err and "Traceback" not in err
        assert (run / "checkpoints" / "step_00000020.tmp").is_dir()
    assert main(["clean", str(run)]) == 0
    assert not (run / "checkpoints" / "step_00000020.tmp").exists()
