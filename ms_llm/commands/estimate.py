"""Per-device memory by component and estimated step time of one or more strategies, from ms_llm's
cost model. Inputs may be in any format convert-strategy reads (ms_llm job YAML, Megatron-LM
script, DeepSpeed JSON, MindFormers YAML, torchtitan TOML). With --plot, a stacked bar per
strategy (params, grads, optimizer states, activations, logits, ZeRO-3 gather buffer) is drawn
side by side against the device memory (needs matplotlib).

examples:
  ms-llm estimate configs/train/llama2_70b_dp2_tp4_pp8.yaml
  ms-llm estimate a.yaml b.sh ds.json --model llama2_7b --device h100 --plot memory.png
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ms_llm.commands import add_input_arguments, read_options, table
from ms_llm.commands.plots import pyplot, save

GB = 1e9
COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "zero3_gather")


@dataclass
class Row:
    label: str
    summary: str
    estimate: object
    device: object
    device_key: str
    world_size: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="strategy files, one bar / row each")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw stacked memory bars to this image")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_input_arguments(parser)


def estimate_files(args: argparse.Namespace) -> list[Row]:
    from ms_llm.convert import load
    from ms_llm.strategy.cost import estimate
    from ms_llm.strategy.devices import get_device
    from ms_llm.strategy.plan import plan
    from ms_llm.strategy.report import strategy_summary
    rows = []
    for path in args.inputs:
        conv = load(path, args.source_format, read_options(args))
        job = conv.job
        key = args.device or job.device
        device = get_device(key)
        p = plan(job.model, job.strategy, job.train, conv.world_size)
        rows.append(Row(Path(path).stem, strategy_summary(p), estimate(p, device), device, key, p.world_size))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = estimate_files(args)
    if args.json:
        print(json.dumps([_json(r) for r in rows], indent=2))
    else:
        print(report(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def report(rows: list[Row]) -> str:
    headers = ["strategy", "devices"] + [c.replace("_", " ") for c in COMPONENTS] + \
              ["total GB", "device GB", "fits", "step s", "bubble s", "comm s", "MFU", "tok/s/dev"]
    body = []
    for r in rows:
        e, mem = r.estimate, r.estimate.memory
        body.append([r.label, f"{r.world_size} x {r.device_key}"]
                    + [f"{v / GB:.2f}" for v in mem.components().values()]
                    + [f"{mem.total / GB:.2f}", f"{r.device.memory_bytes / GB:.0f}", "yes" if e.fits else "NO",
                       f"{e.step_s:.3f}", f"{e.bubble_s:.3f}", f"{sum(e.exposed_comm_s.values()):.3f}",
                       f"{100 * e.mfu:.1f}%", f"{e.tokens_per_s_per_device:,.0f}"])
    lines = ["memory per device (GB, busiest pipeline stage) and step time, from ms_llm's cost model", "",
             table(headers, body, left=2), ""]
    lines += [f"{r.label}: {r.summary}" for r in rows]
    return "\n".join(lines)


def _json(r: Row) -> dict:
    e = r.estimate
    return {"name": r.label, "strategy": r.summary, "world_size": r.world_size, "device": r.device.name,
            "memory_bytes": {**e.memory.components(), "total": e.memory.total, "host_offload": e.memory.host_offload,
                             "device_capacity": r.device.memory_bytes},
            "fits": e.fits, "time_s": {"step": e.step_s, "compute": e.compute_s, "bubble": e.bubble_s,
                                       "exposed_comm": e.exposed_comm_s},
            "mfu": e.mfu, "tokens_per_s_per_device": e.tokens_per_s_per_device}


def plot(rows: list[Row], path: str) -> None:
    """Stacked bar per strategy, one colour per memory component, device capacity as a dashed
    line. Each bar's total and step time sit above the higher of the bar and its capacity line,
    and long strategy names wrap, so no two labels overlap."""
    plt = pyplot("--plot", "plot")
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(rows) + 3), 4.8))
    bottoms = [0.0] * len(rows)
    x = range(len(rows))
    for name in COMPONENTS:
        values = [r.estimate.memory.components()[name] / GB for r in rows]
        if any(values):
            ax.bar(x, values, bottom=bottoms, width=0.7, label=name.replace("_", " "))
            bottoms = [b + v for b, v in zip(bottoms, values)]
    capacity = [r.device.memory_bytes / GB for r in rows]
    top = max(max(bottoms), max(capacity))
    for i, r in enumerate(rows):
        ax.hlines(capacity[i], i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                  label="device capacity" if i == 0 else None)
        ax.annotate(f"{bottoms[i]:.3g} GB\n{r.estimate.step_s:.2f} s/step", (i, max(bottoms[i], capacity[i])),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{_wrap(r.label)}\n{r.world_size} x {r.device_key}" for r in rows],
                  fontsize=8)
    ax.set_ylabel("GB per device (busiest stage)")
    ax.set_title("memory per device and step time")
    ax.set_ylim(0, 1.2 * top)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(plt, fig, path, "--plot")


def _wrap(label: str, width: int = 20) -> str:
    """A file stem on lines of at most `width` characters, broken after underscores where it can."""
    lines = [""]
    for part in label.replace("_", "_ ").split(" "):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(line[i:i + width] for line in lines for i in range(0, len(line), width))
