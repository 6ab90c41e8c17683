"""Resume through the torch trainer (`ms-llm train`, torchrun): the loss after a restart,
under the same or another strategy and world size, equals the uninterrupted run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ms_llm.checkpoint import Checkpoint
from ms_llm.checkpoint.storage.safetensors_io import storage_dtype
from ms_llm.data import build_stdlib_corpus
from ms_llm.processes import descendants
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(name="resume", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, dtype="float32")
MOE = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
FP32 = {"param_dtype": "float32", "compute_dtype": "float32"}


def _job(tmp: Path, name: str, tokens: Path, strategy: dict, interval: int, load: str = "",
         model: dict = MODEL, micro_batch_size: int = 2) -> Path:
    job = {"name": name, "backend": "torch", "device": "cpu", "model": model,
           "strategy": {**strategy, "precision": FP32},
           "train": {"global_batch_size": 8, "micro_batch_size": micro_batch_size, "seq_len": 16, "steps": 6,
                     "seed": 7, "log_every": 1, "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.01},
                     "schedule": {"warmup_steps": 2, "decay": "constant"},   # --steps then only stops early
                     "data": {"source": str(tokens)},
                     "checkpoint": {"interval": interval, "keep_last": 5, "load": load}}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train(config: Path, run: Path, steps: int, backend: str = "torch") -> dict[int, float]:
    proc = subprocess.run([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                           "--steps", str(steps), "--backend", backend], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: dp2, checkpoints every 3 steps."""
    tmp = tmp_path_factory.mktemp("resume")
    tokens = build_stdlib_corpus(tmp / "data", max_bytes=50_000)    # 60 steps draw ~8k tokens
    run = tmp / "ref"
    losses = _train(_job(tmp, "ref", tokens, {"dp": 2}, 3), run, 6)
    return tmp, tokens, run, losses


@pytest.mark.slow
def test_restart_in_place_continues_the_loss_curve(reference):
    tmp, tokens, ref_run, ref = reference
    run = tmp / "restart"
    config = _job(tmp, "restart", tokens, {"dp": 2}, 2)
    first = _train(config, run, 4)                       # "crashes" after step 4 (checkpoint at 4)
    assert [first[k] for k in range(1, 5)] == pytest.approx([ref[k] for k in range(1, 5)], abs=1e-5)
    second = _train(config, run, 6)                      # same run folder: resumes from its latest
    assert sorted(second) == [1, 2, 3, 4, 5, 6]           # steps 5, 6 appended to the metrics
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [second[k] for k in (5, 6)] == pytest.approx([ref[k] for k in (5, 6)], abs=1e-5)
    saves = [r for r in records if "checkpoint_step" in r]
    assert {r["checkpoint_step"] for r in saves if "stall_s" in r} == {2, 4, 6}
    assert all(r["total_s"] >= 0 for r in saves if "total_s" in r)
    # dp2 without ZeRO: rank 0 (which logs) holds every tensor whole, so it read all of step 4.
    [resumed] = [r for r in records if "resumed_step" in r]
    with Checkpoint(run / "checkpoints" / "step_00000004") as ckpt:
        saved = sum(ckpt.entry(n).numel * storage_dtype(ckpt.entry(n).dtype).itemsize for n in ckpt.names())
    assert resumed["resumed_step"] == 4 and resumed["load_bytes"] == saved and resumed["load_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    {"tp": 2},                                                     # DTensor weights and Adam states
    {"dp": 2, "zero": {"stage": 3}},                               # shared ZeRO engine, weight shards
    {"dp": 2, "zero": {"stage": 1, "engine": "native"}},           # ZeroRedundancyOptimizer
    {"dp": 2, "zero": {"stage": 2, "engine": "native"}},           # FSDP2
    {"pp": 2, "pipeline": {"schedule": "gpipe"}},
    {"dp": 1},
], ids=["tp2", "zero3_shared", "zero1_native", "zero2_fsdp2", "pp2", "single"])   # zero1_shared: the damage test
def test_resume_under_another_strategy(reference, strategy, request):
    tmp, tokens, ref_run, ref = reference
    name = "resume_" + request.node.callspec.id
    run = tmp / name
    load = str(ref_run / "checkpoints" / "step_00000003")
    losses = _train(_job(tmp, name, tokens, strategy, 0, load), run, 6)
    assert sorted(losses) == [4, 5, 6]
    assert [losses[k] for k in (4, 5, 6)] == pytest.approx([ref[k] for k in (4, 5, 6)], abs=1e-5)


@pytest.mark.slow
def test_moe_resume_restores_the_expert_optimizer(reference):
    """tiny_moe under ep2 with the shared engine: the routed experts' AdamW moments (their own
    optimizer beside the engine) are saved split over ep; resumed under ep2, under data parallel
    only, and under ep2 x edp2 with ZeRO-1 (the moments sliced over edp, saved so at step 5 and
    resumed whole under ep2), the loss curve is the uninterrupted one."""
    tmp, tokens, _, _ = reference
    ref_run = tmp / "moe_ref"
    ref = _train(_job(tmp, "moe_ref", tokens, {"dp": 2, "ep": 2}, 3, model=MOE), ref_run, 6)
    load = str(ref_run / "checkpoints" / "step_00000003")
    for name, strategy, interval in (("moe_ep2", {"dp": 2, "ep": 2}, 0), ("moe_dp2", {"dp": 2}, 0),
                                     ("moe_edp2_zero1", {"dp": 4, "ep": 2, "zero": {"stage": 1}}, 5)):
        losses = _train(_job(tmp, name, tokens, strategy, interval, load, MOE), tmp / name, 6)
        assert sorted(losses) == [4, 5, 6]
        assert [losses[k] for k in (4, 5, 6)] == pytest.approx([ref[k] for k in (4, 5, 6)], abs=1e-6), name
    sliced = str(tmp / "moe_edp2_zero1" / "checkpoints" / "step_00000005")
    losses = _train(_job(tmp, "moe_from_sliced", tokens, {"dp": 2, "ep": 2}, 0, sliced, MOE),
                    tmp / "moe_from_sliced", 6)
    assert losses == pytest.approx({6: ref[6]}, abs=1e-6)


@pytest.mark.slow
@pytest.mark.mindspore
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["graph_step", "shared_zero3"])
def test_torch_to_mindspore_to_torch_resume(reference, zero_stage):
    """MindSpore (2 msrun workers; its GRAPH step, or the shared ZeRO engine at stage 3 with its
    per-layer gathers in PyNative) continues the torch run from its step-3 checkpoint for one step
    and saves at step 4; torch runs steps 5 and 6 from that, so the weights and the AdamW moments
    MindSpore read and wrote are both on the torch curve: every loss on the torch curve. MindSpore
    takes each rank's 4 rows as one micro-batch (torch: two of 2), which halves its graph and its
    PyNative step; the data and the loss are the same."""
    pytest.importorskip("mindspore")
    tmp, tokens, ref_run, ref = reference
    load = str(ref_run / "checkpoints" / "step_00000003")
    ms_run = tmp / f"ms_resume{zero_stage}"
    ms_job = _job(tmp, f"ms_resume{zero_stage}", tokens, {"dp": 2, "zero": {"stage": zero_stage}}, 4, load,
                  micro_batch_size=4)
    ms_losses = _train(ms_job, ms_run, 4, backend="mindspore")
    assert sorted(ms_losses) == [4]
    assert ms_losses[4] == pytest.approx(ref[4], abs=1e-5)
    saved = ms_run / "checkpoints" / "step_00000004"
    assert (saved / "index.json").is_file()
    back = _train(_job(tmp, f"torch_again{zero_stage}", tokens, {"tp": 2}, 0, str(saved)),
                  tmp / f"torch_again{zero_stage}", 6)
    assert sorted(back) == [5, 6]
    assert [back[k] for k in (5, 6)] == pytest.approx([ref[k] for k in (5, 6)], abs=1e-5)


@pytest.mark.slow
def test_auto_interval_measures_the_first_save_then_decides(reference):
    tmp, tokens, _, _ = reference
    run = tmp / "auto"
    config = _job(tmp, "auto", tokens, {"dp": 1}, 0)
    job = yaml.safe_load(config.read_text())
    job["train"]["checkpoint"]["interval"] = "auto"
    config.write_text(yaml.safe_dump(job))
    losses = _train(config, run, 6)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    records = read_metrics(run / "metrics.jsonl")
    decided = [r for r in records if "checkpoint_interval" in r]
    assert len(decided) == 1 and decided[0]["checkpoint_interval"] >= 1
    first = [r for r in records if r.get("checkpoint_step") == 1 and "stall_s" in r]
    assert first and first[0]["stall_s"] > 0
    assert (run / "checkpoints" / "step_00000001" / "index.json").is_file()


def _workers(pid: int) -> list[int]:
    found = []
    for p in descendants(pid):            # the launcher we started, its torchrun, the workers
        try:
            if b"torch_backend.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_killed_worker_restarts_and_repeats_only_the_steps_since_the_checkpoint(reference):
    """kill -9 of one worker mid-run: torchrun stops the others, `--max-restarts 1` starts them
    again, they resume from the newest checkpoint, the steps after it run again with the
    losses they had the first time, and the run finishes every step."""
    tmp, tokens, _, _ = reference
    run, steps = tmp / "elastic", 60          # four chances (steps 23-27, 33-37, ...) to kill between checkpoints
    config = _job(tmp, "elastic", tokens, {"dp": 2}, 10)
    proc = subprocess.Popen([sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run),
                             "--steps", str(steps), "--max-restarts", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    killed, deadline = None, time.monotonic() + 300
    try:
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            done = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] \
                if (run / "metrics.jsonl").is_file() else []
            if done and done[-1] >= 23 and 3 <= done[-1] % 10 <= 7:      # between two checkpoints
                workers = _workers(proc.pid)
                if workers:
                    os.kill(workers[-1], signal.SIGKILL)
                    killed = done[-1]
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "the run ended before a worker could be killed"
    assert proc.returncode == 0, out[-4000:]
    assert "restart 1 of 1" in out
    records = read_metrics(run / "metrics.jsonl")
    resumed = [r["resumed_step"] for r in records if "resumed_step" in r]
    assert len(resumed) == 1 and resumed[0] % 10 == 0 and 0 < resumed[0] <= killed
    losses: dict[int, list[float]] = {}
    for r in records:
        if "loss" in r:
            losses.setdefault(r["step"], []).append(r["loss"])
    assert sorted(losses) == list(range(1, steps + 1))
    repeated = sorted(k for k, v in losses.items() if len(v) > 1)
    assert repeated[0] == resumed[0] + 1 and repeated[-1] >= killed
    for k in repeated:
        assert losses[k][0] == pytest.approx(losses[k][1], abs=1e-5), k


def _damage_optimizer_shard(folder: Path, file: str) -> str:
    """Flip one byte of an optimizer-state shard stored in `file` (one rank's file)."""
    parts = [json.loads(p.read_text())["tensors"] for p in sorted(folder.glob("index_*.json"))]
    key = next(shard["key"] for part in parts for name, shards in part.items() if name.startswith("optim.")
               for shard in shards if shard["file"] == file)
    data = bytearray((folder / file).read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin = 8 + header + json.loads(data[8:8 + header])[key]["data_offsets"][0]
    data[begin] ^= 0xFF
    (folder / file).write_bytes(data)
    return key


@pytest.mark.slow
def test_damage_seen_by_one_rank_sends_every_rank_back_together(reference):
    """The shared ZeRO engine at stage 1 resumes the dp2 run from its step-3 checkpoint (optimizer
    shards cut from whole moments) on the uninterrupted curve, saving every step. Under ZeRO-1 each
    rank reads its optimizer shard from its own file: a flipped byte in rank 1's file of the newest
    checkpoint fails rank 1 only. Both ranks resume from the previous checkpoint, and the loss curve
    is the uninterrupted one."""
    tmp, tokens, ref_run, ref = reference
    run = tmp / "damaged"
    config = _job(tmp, "damaged", tokens, {"dp": 2, "zero": {"stage": 1}}, 1,
                  str(ref_run / "checkpoints" / "step_00000003"))
    first = _train(config, run, 5)                                     # checkpoints at steps 4 and 5
    assert sorted(first) == [4, 5]
    assert [first[k] for k in (4, 5)] == pytest.approx([ref[k] for k in (4, 5)], abs=1e-5)
    head = json.loads((run / "checkpoints" / "step_00000005" / "index.json").read_text())
    assert [record["also"] for record in head["parts"]] == [[], [0]]  # rank 1's weights are replicas of rank 0's
    _damage_optimizer_shard(run / "checkpoints" / "step_00000005", "rank_00001.safetensors")
    losses = _train(config, run, 6)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["resumed_step"] for r in records if "resumed_step" in r] == [3, 4]
    assert [losses[k] for k in (5, 6)] == pytest.approx([ref[k] for k in (5, 6)], abs=1e-5)
