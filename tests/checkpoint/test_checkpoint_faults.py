"""Faults found by injecting them into checkpoints (issue 39, items 1-4): each is a CheckpointError
in one line, a resume falls back to the previous checkpoint, and nothing blocks or recurses.

1. a list nested 900 deep in the head's `state`, `rank_states` or an index part is refused while
   parsing (untrusted.parse_json);
2. a FIFO in place of an index part, the head, the seal or `latest` does not block: every file
   the reader opens is opened non-blocking and must be a regular file (untrusted.read_regular);
3. the training state is checked against what a resume does with it (run/saved_state.py): a
   negative or huge optimizer_step and a 3-byte torch RNG state are refused, through the real
   trainer in process (a gloo world of one) and once through `ms-llm train`;
4. Checkpoint.verify() reads every index part a load of any rank reads, and `ms-llm checkpoint
   verify` says OK in one line or lists one line per problem.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest
import yaml

from ckpt_helpers import cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, SaveItem, candidates, load_with_fallback, run_config
from ms_llm.cli import main
from ms_llm.errors import CheckpointError
from ms_llm.run.metrics import read_metrics
from ms_llm.run.saved_state import check_saved_state

ROOT = Path(__file__).resolve().parents[2]
DP2 = plan_for({"dp": 2}, 2)            # rank 1 holds replicas only: its index part lists no shard of its own
STEP1, STEP2 = "step_00000001", "step_00000002"


def save(root: Path, ref: dict, step: int) -> None:
    for rank in reversed(range(DP2.world_size)):             # rank 0 last: it commits
        w = CheckpointWriter(root, rank, DP2.world_size, session=f"s{step}")
        w.save(step, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(DP2, rank).items()],
               state={"step": step, "optimizer_step": step}, rank_state={"rng": bytes([rank])},
               config=run_config(DP2, "test"))
        w.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "ckpt"
    ref = reference()
    save(root, ref, 1)
    save(root, {n: a + 1 for n, a in ref.items()}, 2)
    return root


@pytest.fixture
def root(pristine, tmp_path) -> Path:
    out = tmp_path / "checkpoints"
    shutil.copytree(pristine, out)
    return out


def edit_head(folder: Path, edit) -> None:
    head = json.loads((folder / "index.json").read_text())
    edit(head)
    (folder / "index.json").write_text(json.dumps(head))


def write_part(folder: Path, rank: int, data: bytes) -> None:
    """Replace index part `rank` and record it in the head, as a crafted checkpoint would."""
    (folder / f"index_{rank:05d}.json").write_bytes(data)
    edit_head(folder, lambda h: h["parts"][rank].update(bytes=len(data), crc32c=crc32c.crc32c(data)))


def falls_back(root: Path, match: str, rank: int = 1) -> None:
    """Step 2 is refused with `match`; a load with fallback gets step 1's values."""
    pieces = rank_pieces(DP2, rank)
    with pytest.raises(CheckpointError, match=match):
        Checkpoint(root / STEP2, rank=rank).read_pieces(pieces)
    used, arrays = load_with_fallback(candidates(root), lambda c: c.read_pieces(pieces), rank)
    assert used.step == 1
    ref = reference()
    assert all(np.array_equal(arrays[n], cut(ref[n], p.region)) for n, p in pieces.items())


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[:2000]
    return err


# ---- 1. nesting depth -----------------------------------------------------------------------------
def nested(depth: int):
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["state", "rank_states", "index part"])
def test_a_list_nested_900_deep_is_refused_while_parsing_and_falls_back(root, where, capsys):
    folder = root / STEP2
    if where == "state":
        edit_head(folder, lambda h: h["state"].update(scheduler=nested(900)))
    elif where == "rank_states":
        edit_head(folder, lambda h: h["rank_states"]["1"].update(rng=nested(900)))
    else:                                                   # rank 0's: every load and export reads it
        part = json.loads((folder / "index_00000.json").read_text())
        part["extra"] = nested(900)
        write_part(folder, 0, json.dumps(part).encode())
    file = "index_00000.json" if where == "index part" else "index.json"
    falls_back(root, rf"{file}: JSON nested 9\d\d deep; a checkpoint's files nest at most 64")
    one_line_error(["convert-checkpoint", str(folder), str(root.parent / "hf"), "--to", "hf"], capsys)
    one_line_error(["checkpoint", "verify", str(folder)], capsys)


# ---- 2. non-regular files -------------------------------------------------------------------------
class Blocked(BaseException):
    """Not an OSError (TimeoutError is one), so no handler of the code under test swallows it."""


@contextlib.contextmanager
def within(seconds: float):
    """Fail instead of hanging: a blocked open() is interrupted by SIGALRM."""
    def timeout(signum, frame):
        raise Blocked(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def test_a_fifo_index_part_is_refused_without_blocking_and_falls_back(root):
    fifo(root / STEP2 / "index_00001.json")
    with within(10):
        falls_back(root, r"index_00001.json: not a regular file")


def test_a_fifo_head_or_latest_is_refused_without_blocking(root):
    fifo(root / "latest")
    with within(10):
        with pytest.raises(CheckpointError, match=r"latest: not a regular file"):
            Checkpoint.open(root)
        with pytest.raises(CheckpointError, match=r"latest: not a regular file"):
            candidates(root)
    fifo(root / STEP2 / "index.json")
    with within(10):
        with pytest.raises(CheckpointError, match=r"index.json: not a regular file"):
            Checkpoint(root / STEP2)


def test_a_fifo_seal_in_a_memory_tier_is_ignored_without_blocking(root):
    (root / "keeper.lock").write_text("")              # a memory tier: step folders may carry a seal
    fifo(root / STEP2 / "sealed.json")
    with within(10):
        with Checkpoint(root / STEP2) as ckpt:
            ckpt.verify()                              # an unreadable seal only means every block is checked


# ---- 3. the training state ------------------------------------------------------------------------
def torch_rng() -> bytes:
    """A real torch CPU generator state (5056 bytes) without importing torch: seed 3, after 5 draws."""
    state = bytearray(5056)
    struct.pack_into("<QiiQ", state, 0, 3, 620, 1, 5)
    return bytes(state)


def good_state(step: int = 6) -> dict:
    return {"step": step, "optimizer_step": step - 1, "lr": 3e-4,
            "sampler": {"seed": 7, "epoch": 0, "position": 8 * step, "index": ""},
            "loss_scale": {"mode": "dynamic", "scale": 32768.0, "good_steps": 3, "skipped": 1}}


BAD_STATES = {
    "negative optimizer_step": ({"optimizer_step": -5}, r"'state.optimizer_step' is -5; expected an integer in \[0, 6\]"),
    "optimizer_step 1e30": ({"optimizer_step": 1e30}, r"'state.optimizer_step' is 1e\+30; expected an integer"),
    "optimizer_step 10**30": ({"optimizer_step": 10 ** 30}, r"'state.optimizer_step' is 1000000000000000000000000000000"),
    "optimizer_step true": ({"optimizer_step": True}, r"'state.optimizer_step' is True"),
    "steps disagree": ({"step": 5}, r"'state.step' is 5 but the checkpoint is of step 6"),
    "skipped and optimizer_step": ({"optimizer_step": 6}, r"optimizer_step 6 \+ loss_scale.skipped 1 > step 6"),
    "scale nan": ({"loss_scale": {"mode": "dynamic", "scale": float("nan"), "good_steps": 0, "skipped": 1}},
                  r"'state.loss_scale.scale' is nan; expected a number in \[1, 2\*\*64\]"),
    "scale 0": ({"loss_scale": {"mode": "dynamic", "scale": 0, "good_steps": 0, "skipped": 1}},
                r"'state.loss_scale.scale' is 0"),
    "mode": ({"loss_scale": {"mode": "magic", "scale": 2.0, "good_steps": 0, "skipped": 1}},
             r"'state.loss_scale.mode' is 'magic'; expected 'dynamic' or 'static'"),
    "good_steps": ({"loss_scale": {"mode": "dynamic", "scale": 2.0, "good_steps": 5000, "skipped": 1}},
                   r"'state.loss_scale.good_steps' is 5000; expected an integer in \[0, 6\]"),
    "loss_scale list": ({"loss_scale": [1]}, r"'state.loss_scale' is \[1\]; expected null or a JSON object"),
    "sampler position": ({"sampler": {"seed": 7, "epoch": 0, "position": -8, "index": ""}},
                         r"'state.sampler.position' is -8; expected an integer"),
    "sampler epoch": ({"sampler": {"seed": 7, "epoch": "0", "position": 8, "index": ""}},
                      r"'state.sampler.epoch' is '0'; expected an integer"),
    "sampler index": ({"sampler": {"seed": 7, "epoch": 0, "position": 8, "index": 3}},
                      r"'state.sampler.index' is 3; expected a string"),
    "lr": ({"lr": "fast"}, r"'state.lr' is 'fast'; expected a finite number"),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_bad_training_state_is_refused_naming_the_field(case):
    change, match = BAD_STATES[case]
    check_saved_state(good_state(), {0: {"torch_rng": torch_rng()}}, 6, "step_6/index.json")   # the good one passes
    with pytest.raises(CheckpointError, match=match) as err:
        check_saved_state({**good_state(), **change}, {0: {"torch_rng": torch_rng()}}, 6, "step_6/index.json")
    assert str(err.value).startswith("step_6/index.json: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("rng,match", [
    (b"abc", r"'rank_states\[1\].torch_rng' is 3 bytes; torch.get_rng_state\(\) of the CPU generator is 5056"),
    ("abc", r"'rank_states\[1\].torch_rng' is 'abc'; expected 5056 bytes"),
    (bytes(5056), r"'rank_states\[1\].torch_rng' is not a valid mt19937 state \(left 0, seeded 0, next 0\)"),
])
def test_a_bad_torch_rng_state_is_refused(rng, match):
    with pytest.raises(CheckpointError, match=match):
        check_saved_state(good_state(), {0: {"torch_rng": torch_rng()}, 1: {"torch_rng": rng}}, 6, "w")


def test_a_state_without_the_trainers_fields_passes():
    """Imported checkpoints (state {}), hand-saved ones and MindSpore's (no rank state) are fine."""
    check_saved_state({}, {}, 0, "w")
    check_saved_state({"step": 3, "scheduler": {"anything": [1, 2]}}, {0: {"rng": b"\x00"}, 1: {}}, 3, "w")
    check_saved_state({**good_state(), "loss_scale": None, "optimizer_step": 6}, {}, 6, "w")


TINY = {"name": "faults", "vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
        "ffn_hidden_size": 64, "max_seq_len": 16, "dtype": "float32"}


def job_file(tmp: Path) -> Path:
    tokens = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, 64, 20000, dtype=np.uint16).tofile(tokens)
    job = {"name": "faults", "backend": "torch", "device": "cpu", "model": TINY,
           "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 8, "steps": 4, "seed": 3,
                     "log_every": 1, "schedule": {"warmup_steps": 2, "decay": "constant"},   # --steps only stops early
                     "data": {"source": str(tokens)}, "checkpoint": {"interval": 2, "keep_last": 5}}}
    path = tmp / "faults.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


RESUME_CASES = {
    "negative optimizer_step": lambda h: h["state"].update(optimizer_step=-5),
    "optimizer_step 1e30": lambda h: h["state"].update(optimizer_step=1e30),
    "3-byte torch rng": lambda h: h["rank_states"]["0"].update(torch_rng={"__bytes__": base64.b64encode(b"abc").decode()}),
}


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A torch run of 4 steps (checkpoints at 2 and 4), trained in this process in a gloo world of one."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ms_llm.launch import TrainRequest, prepare
    tmp = tmp_path_factory.mktemp("trained")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    _, _, run = prepare(TrainRequest(config=job_file(tmp), run_dir=tmp / "run"))
    train_here(run.root)
    yield tmp, run.root
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def train_here(run: Path) -> None:
    import torch

    from ms_llm.run import RunFolder
    from ms_llm.run.loop import train
    from torch_backend.worker import build_trainer
    train(build_trainer(RunFolder(run), torch.device("cpu")))


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_the_trainer_falls_back_from_a_bad_training_state(trained, case, caplog):
    """The real resume (TrainerCheckpoints under the torch worker's trainer): step 4's state is
    refused in one warning, step 2 loads, and steps 3-4 repeat the first run's losses."""
    tmp, first = trained
    run = tmp / case.replace(" ", "_")
    shutil.copytree(first, run)
    edit_head(run / "checkpoints" / "step_00000004", RESUME_CASES[case])
    (run / "metrics.jsonl").write_text("")
    train_here(run)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["resumed_step"] for r in records if "resumed_step" in r] == [2]
    assert losses(run) == {k: losses(first)[k] for k in (3, 4)}
    warned = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(warned) == 1 and "step_00000004" in warned[0] and "\n" not in warned[0]


@pytest.mark.slow
def test_ms_llm_train_falls_back_from_a_negative_optimizer_step(tmp_path):
    """End to end: `ms-llm train` resumes from step 2, names step 4's field in one line, exits 0."""
    config, run = job_file(tmp_path), tmp_path / "run"

    def train(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run), "--steps",
                               str(steps)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert train(4).returncode == 0
    first = losses(run)
    edit_head(run / "checkpoints" / "step_00000004", RESUME_CASES["negative optimizer_step"])
    out = train(6)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = [line for line in (out.stdout + out.stderr).splitlines() if "unusable" in line]
    assert len(said) == 1 and "'state.optimizer_step' is -5; expected an integer in [0, 4]" in said[0]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["resumed_step"] for r in records if "resumed_step" in r] == [2]
    resumed = [r["loss"] for r in records if "loss" in r][4:]          # after the first run's 4 steps
    assert resumed[:2] == [first[3], first[4]] and len(resumed) == 4


# ---- 4. verify ------------------------------------------------------------------------------------
def test_verify_reads_every_part_a_load_reads(root):
    """dp2: rank 1 saved no shard, so no tensor names its part; its load still reads it (the
    record's `also`), and so does verify."""
    (root / STEP2 / "index_00001.json").unlink()
    with pytest.raises(CheckpointError, match="index_00001.json: missing"):
        Checkpoint(root / STEP2, rank=1).read_pieces(rank_pieces(DP2, 1))
    with pytest.raises(CheckpointError, match="index_00001.json: missing"):
        Checkpoint(root / STEP2).verify()
    Checkpoint(root / STEP1).verify()


def test_checkpoint_verify_command(root, capsys):
    assert main(["checkpoint", "verify", str(root)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"OK: {root / STEP2}: step 2, ")
    assert main(["checkpoint", "verify", str(root), "--step", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {root / STEP1}: step 1, ")
    # two problems, one line each: rank 1's part is gone and a byte of rank 0's shard file flipped
    (root / STEP2 / "index_00001.json").unlink()
    shard = root / STEP2 / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    assert main(["checkpoint", "verify", str(root)]) == 2
    missing, flipped = sorted(capsys.readouterr().err.strip().splitlines())
    assert "index_00001.json: missing" in missing
    assert "rank_00000.safetensors: tensor" in flipped and "fails its checksum" in flipped
    assert main(["checkpoint", "verify", str(root), "--step", "1"]) == 0
    capsys.readouterr()
    err = one_line_error(["checkpoint", "verify", str(root), "--step", "7"], capsys)
    assert "no committed checkpoint of step 7" in err and "steps 1, 2" in err
    one_line_error(["checkpoint", "verify", str(root.parent / "nothing")], capsys)
