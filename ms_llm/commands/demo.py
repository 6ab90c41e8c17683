"""The mission in a few minutes on a laptop's CPU: plan and search on the clusters the
framework targets, convert a peer's config, prepare data, train the tiny LLaMA under several
strategies, lose a rank and recover, continue the same checkpoint on the other backend,
export to Hugging Face and generate, and write a report.

Every step is the `ms-llm` command it prints, run as a user would run it; everything is
written under one folder (default runs/demo-<time>), named in the closing summary.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ms_llm.errors import ConfigError
from ms_llm.run.heartbeat import read_heartbeats
from ms_llm.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
# The demo's tiny job: fp32 on both backends (MindSpore's CPU MatMul has no bfloat16), so the
# MindSpore continuation can be compared with torch's loss for loss.
PRECISION = {"param_dtype": "float32", "compute_dtype": "float32"}
STEPS, CKPT_EVERY, KILL_AT, MS_FROM = 40, 10, 15, 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="folder for everything the demo writes; default runs/demo-<time>")


@dataclass
class Demo:
    out: Path
    section: int = 0
    failures: list[str] = field(default_factory=list)

    def header(self, title: str, what: str) -> None:
        self.section += 1
        bar = "=" * 78
        print(f"\n{bar}\n{self.section}. {title}\n   {what}\n{bar}", flush=True)

    def ms_llm(self, *args: str, quiet: bool = False) -> subprocess.CompletedProcess:
        """Run `ms-llm ARGS` as a user would, echoing the command; a failure stops the demo."""
        shown = " ".join(_short(a) for a in args)
        print(f"\n$ ms-llm {shown}", flush=True)
        result = subprocess.run([sys.executable, "-m", "ms_llm", *args], cwd=ROOT, text=True,
                                capture_output=quiet)
        if result.returncode != 0:
            if quiet:
                sys.stderr.write(result.stdout + result.stderr)
            raise ConfigError(f"demo: 'ms-llm {shown}' exited with status {result.returncode}")
        return result

    def job(self, name: str, **train: object) -> Path:
        """A tiny-LLaMA job on the prepared data, written where the summary lists it."""
        strategy = train.pop("strategy", {"dp": 2})
        body = {"name": name, "backend": train.pop("backend", "torch"), "device": "cpu", "model": "tiny",
                "strategy": {**strategy, "precision": PRECISION},
                "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 128, "steps": STEPS,
                          "log_every": 5, "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0},
                          "schedule": {"warmup_steps": 5},
                          "data": {"paths": [str(self.out / "data" / "stdlib")],
                                   "tokenizer": str(self.out / "data" / "tokenizer.json"), "split": "98,2,0"},
                          "eval": {"interval": CKPT_EVERY, "batches": 2}, **train}}
        path = self.out / "jobs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        return path


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"demo: {out} is not empty; pass --out with a new folder")
    out.mkdir(parents=True, exist_ok=True)
    demo = Demo(out)
    started = time.monotonic()
    plan_and_search(demo)
    convert_peer_config(demo)
    runs = train_strategies(demo)
    recovered = lose_a_rank(demo)
    continued = continue_on_mindspore(demo, runs["dp2_zero1"])
    export_and_generate(demo, recovered)
    report(demo, [recovered, continued])
    summary(demo, time.monotonic() - started)
    return 0


def plan_and_search(demo: Demo) -> None:
    demo.header("Plan and search before spending cluster hours",
                "mesh, memory per device, communication and step time for two real clusters, then the cost-"
                "model search of every strategy for LLaMA-2-70B on 1024 H100")
    demo.ms_llm("plan", str(CONFIGS / "train" / "llama2_7b_dp8_zero1.yaml"), "--device", "910b")
    demo.ms_llm("plan", str(CONFIGS / "train" / "llama3_70b_h100_dp8_tp8_pp4.yaml"))
    demo.ms_llm("search", "--model", "llama2_70b", "--world-size", "1024", "--device", "h100",
                "--global-batch-size", "1024", "--seq-len", "4096", "--top", "5",
                "-o", str(demo.out / "search_llama2_70b_1024xh100.yaml"))


def convert_peer_config(demo: Demo) -> None:
    demo.header("Convert a MindFormers config",
                "a MindFormers 2.x LLaMA-2-7B pretrain YAML becomes an ms_llm job (the torch backend's verdict "
                "on H100 below) and Megatron-LM arguments; what a target cannot express is named")
    source = CONFIGS / "examples" / "mindformers2_llama2_7b.yaml"
    demo.ms_llm("convert-strategy", str(source), "--to", "ms_llm", "-o", str(demo.out / "llama2_7b_from_mindformers.yaml"))
    demo.ms_llm("convert-strategy", str(source), "--to", "megatron", "-o", str(demo.out / "train_llama2_7b_megatron.sh"))
    demo.ms_llm("plan", str(demo.out / "llama2_7b_from_mindformers.yaml"), "--backend", "torch", "--device", "h100")


def train_strategies(demo: Demo) -> dict[str, Path]:
    demo.header("Prepare data and train the tiny LLaMA under three strategies",
                "the embedded corpus (the Python standard library) with a BPE tokenizer trained on it, then "
                "torch dp2 + ZeRO-1 with checkpoints and validation loss, and tp2 and pp2 for a few steps")
    demo.ms_llm("prepare-data", "--input", "stdlib", "--train-tokenizer", "bpe", "--vocab-size", "320",
                "--output", str(demo.out / "data" / "stdlib"))
    runs = {}
    for name, strategy, steps, extra in (
            ("dp2_zero1", {"dp": 2, "zero": {"stage": 1}}, STEPS,
             {"checkpoint": {"interval": CKPT_EVERY, "keep_last": STEPS // CKPT_EVERY}}),
            ("tp2", {"dp": 1, "tp": 2}, 10, {}),
            ("pp2", {"dp": 1, "pp": 2, "pipeline": {"schedule": "1f1b"}}, 10, {})):
        job = demo.job(f"tiny_{name}", strategy=strategy, steps=steps, **extra)
        runs[name] = demo.out / "runs" / name
        demo.ms_llm("train", str(job), "--run-dir", str(runs[name]))
    return runs


def lose_a_rank(demo: Demo) -> Path:
    demo.header("Lose a rank mid-run and recover",
                f"the same dp2 + ZeRO-1 job again; rank 1 is killed (SIGKILL) at step {KILL_AT}; "
                f"the elastic supervisor sees the death, stops the survivor and releases its standby workers, "
                f"which resume from the step-{KILL_AT // CKPT_EVERY * CKPT_EVERY} checkpoint; the losses must equal "
                "the uninterrupted run's")
    job = demo.job("tiny_dp2_zero1_killed", strategy={"dp": 2, "zero": {"stage": 1}}, steps=STEPS,
                   checkpoint={"interval": CKPT_EVERY})
    run_dir = demo.out / "runs" / "dp2_zero1_killed"
    args = ["train", str(job), "--run-dir", str(run_dir), "--elastic"]
    print(f"\n$ ms-llm {' '.join(_short(a) for a in args)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "ms_llm", *args], cwd=ROOT, start_new_session=True)
    try:
        killed_at, victim = _kill_rank_at(run_dir, rank=1, step=KILL_AT, proc=proc)
        print(f"\n>>> demo: killed rank 1 (pid {victim}) after step {KILL_AT}", flush=True)
        recovery = _first_step_after(run_dir / "metrics.jsonl", killed_at, proc)
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    if status != 0:
        raise ConfigError(f"demo: the recovering run exited with status {status}; see {run_dir}/launcher.log")
    recovered = [r for r in _records(run_dir) if r.get("event") == "recovered"]
    print(f"\n>>> demo: {recovery:.1f} s from the kill to the first new step (the supervisor's own figure, "
          f"from detection: {recovered[-1]['recovery_s']:.1f} s)" if recovered else
          f"\n>>> demo: {recovery:.1f} s from the kill to the first new step")
    _compare_losses(demo.out / "runs" / "dp2_zero1", run_dir, "uninterrupted", "killed and recovered", STEPS)
    return run_dir


def continue_on_mindspore(demo: Demo, torch_run: Path) -> Path:
    demo.header("Continue the same checkpoint on MindSpore",
                f"MindSpore loads the torch run's step-{MS_FROM} checkpoint (one shared format: weights, AdamW "
                f"moments, data position) and trains to step {STEPS}; its losses are compared with torch's own")
    job = demo.job("tiny_dp2_mindspore", backend="mindspore", strategy={"dp": 2}, steps=STEPS,
                   checkpoint={"load": str(torch_run / "checkpoints" / f"step_{MS_FROM:08d}")})
    run_dir = demo.out / "runs" / "dp2_mindspore"
    demo.ms_llm("train", str(job), "--run-dir", str(run_dir))
    _compare_losses(torch_run, run_dir, "torch", "MindSpore", STEPS, first=MS_FROM + 1)
    return run_dir


def export_and_generate(demo: Demo, run_dir: Path) -> None:
    demo.header("Export to Hugging Face and generate",
                "the final checkpoint becomes a transformers LlamaForCausalLM folder; transformers loads it "
                "and continues a prompt with the tokenizer the data was made with")
    hf = demo.out / "hf_export"
    demo.ms_llm("convert-checkpoint", str(run_dir / "checkpoints"), str(hf), "--to", "hf")
    print(f"\n$ python -c 'AutoModelForCausalLM.from_pretrained(\"{_short(str(hf))}\").generate(...)'", flush=True)
    code = ("import sys, transformers; transformers.utils.logging.disable_progress_bar(); "
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "t = transformers.PreTrainedTokenizerFast(tokenizer_file=sys.argv[2]); "
            "ids = t('import os\\nimport ', return_tensors='pt').input_ids; "
            "out = m.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0); "
            "print(repr(t.decode(out[0])))")
    subprocess.run([sys.executable, "-c", code, str(hf), str(demo.out / "data" / "tokenizer.json")], check=True,
                   env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def report(demo: Demo, runs: list[Path]) -> None:
    demo.header("Write the report", "loss curves of both backends on one plot with the recovery marked, "
                                    "throughput, TensorBoard events, and the memory breakdown of the plans")
    folder = demo.out / "report"
    demo.ms_llm("report", *map(str, runs), "-o", str(folder))
    demo.ms_llm("estimate", str(CONFIGS / "train" / "llama2_7b_dp8_zero1.yaml"),
                str(CONFIGS / "train" / "llama3_70b_h100_dp8_tp8_pp4.yaml"), "--plot", str(folder / "memory.png"))
    with open(folder / "summary.md", "a") as summary_md:
        summary_md.write("\n## Memory per device of the two cluster plans\n\n![memory per device](memory.png)\n")
    print(f"\nTensorBoard: tensorboard --logdir {_short(str(demo.out / 'runs'))}")


def summary(demo: Demo, seconds: float) -> None:
    print(f"\n{'=' * 78}\nDemo finished in {seconds / 60:.1f} min. Everything is under {demo.out}:")
    for path in sorted(demo.out.iterdir()):
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file()]
            print(f"  {path.name}/  ({len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB)")
            for sub in sorted(path.iterdir()):
                print(f"      {sub.name}{'/' if sub.is_dir() else ''}")
        else:
            print(f"  {path.name}")


def _kill_rank_at(run_dir: Path, rank: int, step: int, proc: subprocess.Popen) -> tuple[float, int]:
    """SIGKILL `rank`'s worker once its heartbeat reports `step`; bounded by 10 minutes."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        beat = read_heartbeats(run_dir / "heartbeat").get(rank)
        if beat and beat["step"] >= step:
            os.kill(beat["pid"], signal.SIGKILL)
            return time.time(), beat["pid"]
        if proc.poll() is not None:
            raise ConfigError(f"demo: the run ended before rank {rank} reached step {step}; see {run_dir}")
        time.sleep(0.05)
    raise ConfigError(f"demo: rank {rank} did not reach step {step} within 10 minutes; see {run_dir}")


def _first_step_after(metrics: Path, since: float, proc: subprocess.Popen) -> float:
    """Seconds from `since` to the first step record written after a resume (the first new step)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        records = read_metrics(metrics) if metrics.is_file() else []
        resumed = [i for i, r in enumerate(records) if "resumed_step" in r]
        if resumed and any("loss" in r for r in records[resumed[-1]:]):
            return time.time() - since
        time.sleep(0.05)
    raise ConfigError(f"demo: no step after the restart within 10 minutes; see {metrics.parent}/launcher.log")


def _records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the last time each step ran (a recovered run logs replayed steps twice)."""
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r and "step" in r}


def _compare_losses(a: Path, b: Path, name_a: str, name_b: str, last: int, first: int = 1) -> None:
    la, lb = _losses(a), _losses(b)
    steps = [s for s in range(first, last + 1) if s in la and s in lb]
    diff = max(abs(la[s] - lb[s]) for s in steps)
    print(f"\n{'step':>6} {name_a:>22} {name_b:>22}")
    for s in steps:
        if s == steps[0] or s % 5 == 0 or s == steps[-1]:
            print(f"{s:>6} {la[s]:>22.6f} {lb[s]:>22.6f}")
    print(f">>> demo: steps {steps[0]}-{steps[-1]}: largest loss difference {diff:.2e}")


def _short(arg: str) -> str:
    """Paths under the checkout are shown relative to it, as a user types them."""
    try:
        return str(Path(arg).relative_to(ROOT))
    except ValueError:
        return arg
