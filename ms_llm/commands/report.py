"""The report of one or more run folders: a loss-curve PNG (train and validation loss; several runs
on one plot, e.g. a torch run and the MindSpore run that continues its checkpoint, each labelled by
its backend; resumes and failures as vertical lines), a throughput PNG, and summary.md linking
them with a table per run (steps, final loss, tokens/s, MFU, backend, strategy, restarts). Reads
only each run's config.yaml and metrics.jsonl; needs matplotlib (pip install 'ms_llm[report]').

examples:
  ms-llm report runs/tiny_torch_dp2-20260101-120000
  ms-llm report runs/torch_run runs/ms_run          # one plot; written to runs/torch_run/report/
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ms_llm.commands.plots import pyplot, save
from ms_llm.errors import ConfigError


@dataclass
class Run:
    """One run folder as the report reads it: the last record of each step wins (a restarted
    launch replays the steps after its checkpoint)."""
    folder: Path
    backend: str
    strategy: str
    steps: dict[int, dict]                                  # step -> its metrics record
    resumes: list[int] = field(default_factory=list)        # checkpoint step each launch resumed from
    failures: list[tuple[int, str]] = field(default_factory=list)   # (step, kind) the supervisor saw
    recovery_s: list[float] = field(default_factory=list)
    loads: list[tuple[float, int]] = field(default_factory=list)   # (seconds, bytes) of each resume's load
    first_resume: int | None = None                         # the step the run's first launch resumed from

    @property
    def label(self) -> str:
        return f"{self.backend}: {self.folder.name}"

    @property
    def restarts(self) -> int:
        """Resumes inside this run (a first launch that continues another run's checkpoint is not one)."""
        return len(self.resumes) - (self.first_resume is not None)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(s, r[key]) for s, r in sorted(self.steps.items()) if isinstance(r.get(key), (int, float))]
        return [s for s, _ in points], [v for _, v in points]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, drawn on one plot in this order")
    parser.add_argument("-o", "--output", default=None, metavar="DIR",
                        help="report folder (default: the first RUN_DIR's report/)")


def read_run(folder: Path) -> Run:
    from ms_llm.job import load_job
    from ms_llm.run.metrics import read_metrics
    from ms_llm.strategy.plan import plan
    from ms_llm.strategy.report import strategy_summary
    if not (folder / "metrics.jsonl").is_file():
        raise ConfigError(f"{folder}: holds no metrics.jsonl; give a run folder `ms-llm train` wrote")
    job = load_job(folder / "config.yaml") if (folder / "config.yaml").is_file() else None
    run = Run(folder, job.backend if job else "?",
              strategy_summary(plan(job.model, job.strategy, job.train)) if job else "?", {})
    records = read_metrics(folder / "metrics.jsonl")          # whole JSON objects only: nothing to refuse
    for r in records:
        if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float)):
            run.steps[r["step"]] = r
        elif isinstance(r.get("resumed_step"), int):
            run.resumes.append(r["resumed_step"])
            if isinstance(r.get("load_s"), (int, float)) and isinstance(r.get("load_bytes"), int):
                run.loads.append((float(r["load_s"]), r["load_bytes"]))
            if not run.steps and run.first_resume is None:
                run.first_resume = r["resumed_step"]
        elif r.get("event") == "failure" and isinstance(r.get("step"), int):
            run.failures.append((r["step"], str(r.get("kind", "failure"))))
        elif r.get("event") == "recovered" and isinstance(r.get("recovery_s"), (int, float)):
            run.recovery_s.append(float(r["recovery_s"]))
    if not run.steps:
        raise ConfigError(f"{folder / 'metrics.jsonl'}: holds no step record yet; report a run that trained a step")
    return run


def run(args: argparse.Namespace) -> int:
    runs = [read_run(Path(f)) for f in args.runs]
    out = Path(args.output) if args.output else Path(args.runs[0]) / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output: cannot create {out} ({exc.strerror})") from None
    plt = pyplot("report", "report")
    files = [plot_loss(plt, runs, out / "loss.png"), plot_throughput(plt, runs, out / "throughput.png")]
    (out / "summary.md").write_text(summary(runs, files))
    for path in files + [out / "summary.md"]:
        print(f"wrote {path}")
    return 0


def plot_loss(plt, runs: list[Run], path: Path) -> Path:
    """Train loss as lines, validation loss as dots, one colour per run; a dotted vertical line
    where a launch resumed from a checkpoint, a dashed red one where the supervisor saw a failure."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    marked = set()
    for i, r in enumerate(runs):
        colour = f"C{i}"
        ax.plot(*r.series("loss"), color=colour, linewidth=1.4, label=f"{r.label} train")
        steps, values = r.series("val_loss")
        if steps:
            ax.plot(steps, values, "o--", color=colour, markersize=4, linewidth=0.8, label=f"{r.label} validation")
        for step in r.resumes:
            ax.axvline(step, color=colour, linestyle=":", linewidth=1.2,
                       label=None if ("resume", i) in marked else f"{r.label} resumed from checkpoint")
            marked.add(("resume", i))
        for step, kind in r.failures:
            ax.axvline(step, color="red", linestyle="--", linewidth=1.0,
                       label=None if ("failure", kind) in marked else f"failure ({kind})")
            marked.add(("failure", kind))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(plt, fig, path, "report", dpi=110)


def plot_throughput(plt, runs: list[Run], path: Path) -> Path:
    """Tokens/s of the whole job (top) and peak memory per rank (bottom) per step, one colour per
    run. MFU is tokens/s times a constant of the run, so it is in the summary table, not drawn twice."""
    fig, (rate_ax, mem_ax) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for i, r in enumerate(runs):
        rate_ax.plot(*r.series("tokens_per_s"), color=f"C{i}", linewidth=1.2, label=r.label)
        mem_ax.plot(*r.series("memory_gb"), color=f"C{i}", linewidth=1.2)
        for ax in (rate_ax, mem_ax):
            for step in r.resumes:
                ax.axvline(step, color=f"C{i}", linestyle=":", linewidth=1.0)
    rate_ax.set_ylabel("tokens/s (whole job)")
    mem_ax.set_ylabel("peak memory GB (rank 0)")
    mem_ax.xaxis.get_major_locator().set_params(integer=True)
    mem_ax.set_xlabel("step")
    rate_ax.set_title("throughput and memory")
    for ax in (rate_ax, mem_ax):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    rate_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(plt, fig, path, "report", dpi=110)


def summary(runs: list[Run], files: list[Path]) -> str:
    rows = []
    for r in runs:
        last = r.steps[max(r.steps)]
        val = [v for _, v in zip(*r.series("val_loss"))]
        # The first step pays for compilation and warm-up: the median of the rest is the rate.
        rates = [r.steps[s]["tokens_per_s"] for s in sorted(r.steps)[1:]] or [last["tokens_per_s"]]
        mfus = [r.steps[s].get("mfu", 0.0) for s in sorted(r.steps)[1:]] or [last.get("mfu", 0.0)]
        rows.append([r.folder.name, r.backend, r.strategy, f"{min(r.steps)}-{max(r.steps)}", f"{last['loss']:.4f}",
                     f"{val[-1]:.4f}" if val else "-", f"{statistics.median(rates):,.0f}",
                     f"{100 * statistics.median(mfus):.2f}%", str(r.restarts),
                     ", ".join(f"{s:.1f} s" for s in r.recovery_s) or "-",
                     ", ".join(f"{s:.2f} s ({n / 1e6:,.1f} MB)" for s, n in r.loads) or "-"])
    headers = ["run", "backend", "strategy", "steps", "final loss", "final val loss", "tokens/s (median)",
               "MFU (median)", "restarts", "recovery", "checkpoint load (rank 0)"]
    lines = ["# Run report", ""]
    lines += [f"![{p.stem}]({p.name})" for p in files] + [""]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Folders: " + ", ".join(f"`{r.folder}`" for r in runs),
              "Loss plot: lines are train loss, dots validation loss; dotted vertical lines mark where a launch "
              "resumed from a checkpoint, dashed red ones a failure."]
    return "\n".join(lines) + "\n"
