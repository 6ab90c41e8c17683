"""Recovery after kill -9 of one worker, three ways, side by side in one run; hang detection latency.

    .venv/bin/python bench/elastic.py [--trials 3] [--nproc 2] [--hang-timeout 4]

  supervisor     ms-llm train --elastic            (ms_llm.elastic: PID + heartbeat watch, kill by PID, relaunch
                                                     into its standby launch, killed once the standby waits)
  cold           the same, killed at once (the standby still importing: what a first failure costs)
  relaunch       ms-llm train --max-restarts 1     (torchrun stops the others and exits; the launcher starts it again)
  torchrun       torchrun --max-restarts 1 ...     (torchrun's own agent restarts the worker group)
  mindspore      ms-llm train --elastic, MindSpore  (its standby msrun opened; the graphs load from the run's compile
                                                     cache), killed once the standby waits
  ms-cold        the same, killed at once (the standby still importing)
  ms-no-cache    the same as ms-cold with MS_COMPILER_CACHE_ENABLE=0 (the relaunch compiles again)

Recovery is measured the same way for all three, from outside: the kill, then the first heartbeat
of a step completed by a process that did not exist before the kill (every rank resumes from the
newest checkpoint, so this is "failure -> first new step"). Hang detection: SIGSTOP of one rank
under --elastic --hang-timeout T, then the supervisor's failure record. The tiny model, dp on
`--nproc` CPU processes, a checkpoint every 5 steps; MindSpore runs configs/train/tiny_ms_dp2.yaml's
model (`--ms-trials`, 0 to leave it out).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ms_llm.data import build_stdlib_corpus  # noqa: E402
from ms_llm.launch import TrainRequest, prepare  # noqa: E402
from ms_llm.nodes import worker_env  # noqa: E402
from ms_llm.processes import descendants, kill_all  # noqa: E402
from ms_llm.run.heartbeat import read_heartbeats  # noqa: E402
from ms_llm.run.metrics import read_metrics  # noqa: E402
from torch_backend.launch import torch_command  # noqa: E402

MODEL = dict(name="bench-elastic", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, dtype="float32")
STEPS, KILL_AT = 2000, 13


def job_file(tmp: Path, backend: str = "torch") -> Path:
    tokens = build_stdlib_corpus(tmp / "data", max_bytes=200_000)
    model = MODEL if backend == "torch" else yaml.safe_load((ROOT / "configs/train/tiny_ms_dp2.yaml").read_text())[
        "model"]
    job = {"name": "bench-elastic", "backend": backend, "device": "cpu", "model": model,
           "strategy": {"dp": -1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
           "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                     "log_every": 50, "optimizer": {"name": "adamw", "lr": 1e-2},
                     "schedule": {"warmup_steps": 2, "decay": "constant"}, "data": {"source": str(tokens)},
                     "checkpoint": {"interval": 5, "keep_last": 2}}}
    path = tmp / f"job-{backend}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def command(mode: str, config: Path, run: Path, nproc: int, hang_timeout: float) -> tuple[list[str], dict, Path]:
    train = [sys.executable, "-m", "ms_llm", "train", str(config), "--run-dir", str(run), "--nproc", str(nproc)]
    if mode in ("supervisor", "cold", "mindspore", "ms-cold"):
        return train + ["--elastic", "--max-restarts", "1"], dict(os.environ), ROOT
    if mode == "ms-no-cache":
        return train + ["--elastic", "--max-restarts", "1"], dict(os.environ, MS_COMPILER_CACHE_ENABLE="0"), ROOT
    if mode == "hang":
        return train + ["--elastic", "--max-restarts", "1", "--hang-timeout", str(hang_timeout)], dict(os.environ), ROOT
    if mode == "relaunch":
        return train + ["--max-restarts", "1"], dict(os.environ), ROOT
    # torchrun's own restart: the run folder prepared by the launcher, then torchrun alone.
    _, _, folder = prepare(TrainRequest(config, nproc=nproc, run_dir=run))
    cmd = torch_command(folder, nproc, TrainRequest(config).nodes)
    return [cmd[0], cmd[1], cmd[2], "--max-restarts=1", *cmd[3:]], worker_env(folder, TrainRequest(config).nodes), ROOT


def standby_ready(run: Path, processes: int) -> bool:
    """The supervisor's standby launch has every process waiting at its (unopened) gate."""
    waiting = [p for p in (run / "elastic").glob("gate.node0.*.waiting.*")]
    return sum(not Path(str(p).split(".waiting.")[0]).exists() for p in waiting) >= processes


def trial(mode: str, config: Path, tmp: Path, n: int, nproc: int, hang_timeout: float) -> Optional[float]:
    """Seconds from the signal to the first new step (or, for 'hang', to the supervisor's failure
    record); None when the job ended without recovering."""
    run = tmp / f"{mode}-{n}"
    cmd, env, cwd = command(mode, config, run, nproc, hang_timeout)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        beats, deadline = {}, time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            beats = read_heartbeats(run / "heartbeat")
            if beats.get(nproc - 1, {}).get("phase") == "train" and beats[nproc - 1]["step"] >= KILL_AT \
                    and (mode != "supervisor" or standby_ready(run, nproc)) \
                    and (mode != "mindspore" or standby_ready(run, nproc + 1)):       # + msrun's scheduler
                break
            time.sleep(0.005)
        old = {b["pid"] for b in beats.values()}
        sig = signal.SIGSTOP if mode == "hang" else signal.SIGKILL
        os.kill(beats[nproc - 1]["pid"], sig)
        hit = time.time()
        while time.monotonic() < deadline and proc.poll() is None:
            if mode == "hang":
                found = [r["time"] for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "failure"]
                if found:
                    return found[0] - hit
            elif any(b["phase"] == "train" and b["pid"] not in old for b in read_heartbeats(run / "heartbeat").values()):
                return time.time() - hit
            time.sleep(0.005)
        return None
    finally:                                   # the job, its launcher(s) and workers (sessions of their own)
        kill_all([proc.pid, *descendants(proc.pid)])
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hang-timeout", type=float, default=4.0)
    ap.add_argument("--ms-trials", type=int, default=2, help="MindSpore trials per mode (slow on CPU)")
    args = ap.parse_args()
    ms_modes = ["mindspore", "ms-cold", "ms-no-cache"]
    modes = ["supervisor", "cold", "relaunch", "torchrun", "hang"] + (ms_modes if args.ms_trials else [])
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        configs = {"torch": job_file(Path(tmp)), "mindspore": job_file(Path(tmp), "mindspore")}
        for n in range(max(args.trials, args.ms_trials)):        # interleaved: load changes hit every mode alike
            for mode in modes:
                if n >= (args.ms_trials if mode in ms_modes else args.trials):
                    continue
                config = configs["mindspore" if mode in ms_modes else "torch"]
                t = trial(mode, config, Path(tmp), n, args.nproc, args.hang_timeout)
                times[mode].append(t)
                print(f"  trial {n + 1} {mode:10s} " + (f"{t:6.2f} s" if t is not None else "no recovery: the job "
                      "ended (see its launcher.log)"), flush=True)
    print(f"\nkill -9 of one of {args.nproc} workers at step >= {KILL_AT}, checkpoint every 5 steps; "
          f"{args.trials} torch / {args.ms_trials} MindSpore trial(s) each; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'':36s}{'mean s':>8s}{'min s':>8s}{'max s':>8s}{'vs supervisor':>15s}{'recovered':>11s}")
    bases = {m: statistics.mean([x for x in times.get(m, []) if x is not None] or [float("nan")])
             for m in ("supervisor", "mindspore")}
    labels = {"supervisor": "recovery: ms-llm --elastic", "cold": "  the same, before its standby is up",
              "relaunch": "recovery: ms-llm --max-restarts 1",
              "torchrun": "recovery: torchrun --max-restarts 1",
              "hang": f"hang detection (--hang-timeout {args.hang_timeout:g})",
              "mindspore": "recovery: MindSpore --elastic", "ms-cold": "  the same, before its standby is up",
              "ms-no-cache": "  the same, compile cache off too"}
    for mode in modes:
        t = [x for x in times[mode] if x is not None]
        done = f"{len(t)}/{len(times[mode])}"
        if not t:
            print(f"{labels[mode]:36s}{'-':>8s}{'-':>8s}{'-':>8s}{'-':>15s}{done:>11s}")
            continue
        base = bases["mindspore" if mode in ms_modes else "supervisor"]
        ratio = f"{statistics.mean(t) / base:14.2f}x" if mode != "hang" else f"{'-':>15s}"
        print(f"{labels[mode]:36s}{statistics.mean(t):8.2f}{min(t):8.2f}{max(t):8.2f}{ratio}{done:>11s}")
    print(json.dumps({m: [x if x is None else round(x, 3) for x in t] for m, t in times.items()}))


if __name__ == "__main__":
    main()
