"""`ms-llm convert-checkpoint` and `ms-llm ckpt-interval`.

convert-checkpoint moves between ms_llm checkpoints and Hugging Face, MindSpore (per-rank
.ckpt + strategy files) and torch DCP folders, and reshards ms_llm checkpoints. Any pair
not involving ms_llm goes through a temporary ms_llm checkpoint. Framework code is
imported only by the branch that needs it (torch for DCP, MindSpore for MindSpore).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ms_llm.checkpoint.hf import export_hf, import_hf
from ms_llm.checkpoint.interval import IntervalInputs, choose_interval
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import layout_plan, reshard
from ms_llm.config.job import load_section
from ms_llm.errors import ConfigError

FORMATS = ("ms_llm", "hf", "mindspore", "dcp")


def _section(kind: str, value: str | None, flag: str):
    if value is None:
        raise ConfigError(f"convert-checkpoint: {flag} is required for this conversion")
    return load_section(kind, value)


def _target(args, src: Path):
    """The ModelPlan the output is laid out for (--strategy, --world-size)."""
    strategy = _section("strategy", args.strategy, "--strategy")
    model = _section("model", args.model, "--model") if args.model else Checkpoint.open(src).model_config()
    return layout_plan(model, strategy, args.world_size)


def _import(args, fmt: str, src: Path, dst: Path) -> Path:
    if fmt == "hf":
        return import_hf(src, dst)
    model = _section("model", args.model, "--model")
    if fmt == "dcp":
        from torch_backend.checkpoint import import_dcp
        return import_dcp(src, dst, model, names=args.names, step=args.step)
    from ms_llm.mindspore.checkpoint import import_mindspore
    if args.ms_strategy is None:
        raise ConfigError("convert-checkpoint: --ms-strategy (a strategy file or a folder of rank_<r>.ckpt "
                          "strategy files) is required to import MindSpore checkpoints")
    return import_mindspore(src, Path(args.ms_strategy), dst, model, step=args.step)


def _export(args, fmt: str, src: Path, dst: Path) -> Path:
    if fmt == "hf":
        return export_hf(src, dst, dtype=args.dtype)
    if fmt == "dcp":
        from torch_backend.checkpoint import export_dcp
        return export_dcp(src, dst, names=args.names)
    if fmt == "mindspore":
        from ms_llm.mindspore.checkpoint import export_mindspore
        return export_mindspore(src, dst, _target(args, src))
    return reshard(src, dst, _target(args, src))


def cmd_convert(args) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if args.src_format == "ms_llm":
        out = _export(args, args.to, src, dst)
    elif args.to == "ms_llm" and args.strategy is None:
        out = _import(args, args.src_format, src, dst)
    else:                                        # through a temporary ms_llm checkpoint
        dst.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
            mid = _import(args, args.src_format, src, Path(tmp))
            out = _export(args, args.to, mid, dst)
    print(f"wrote {out}")
    return 0


def cmd_interval(args) -> int:
    stall, total = args.stall, args.total
    if args.checkpoint:
        stats = Checkpoint.open(args.checkpoint).index.save_stats
        if "stall_s" not in stats:
            raise ConfigError(f"ckpt-interval: {args.checkpoint} records no save timings; give --stall and --total")
        stall = stats["stall_s"] if stall is None else stall
        total = stats["stall_s"] + stats["persist_s"] if total is None else total
    if stall is None or total is None or args.iter is None:
        raise ConfigError("ckpt-interval: give --stall, --total (or --checkpoint DIR) and --iter")
    restore = total if args.restore is None else args.restore
    decision = choose_interval(IntervalInputs(stall, total, args.iter, restore, args.mtbf_hours))
    print(decision.report())
    return 0


def register(sub) -> None:
    c = sub.add_parser("convert-checkpoint", help="export / import Hugging Face, MindSpore, DCP; reshard")
    c.add_argument("src", help="source folder (an ms_llm checkpoint root or step folder, or a foreign folder)")
    c.add_argument("dst", help="output folder")
    c.add_argument("--from", dest="src_format", choices=FORMATS, default="ms_llm")
    c.add_argument("--to", choices=FORMATS, default="ms_llm")
    c.add_argument("--strategy", help="strategy YAML or name: the layout to write (MindSpore export, reshard)")
    c.add_argument("--world-size", type=int, default=None, help="world size for --strategy")
    c.add_argument("--model", help="model YAML or name (imports from DCP / MindSpore carry no model config)")
    c.add_argument("--ms-strategy", help="MindSpore strategy file, or folder of rank_<r>.ckpt strategy files")
    c.add_argument("--names", choices=("hf", "torchtitan"), default="hf", help="DCP tensor names")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="Hugging Face export dtype")
    c.add_argument("--step", type=int, default=0, help="step recorded for imported checkpoints")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("ckpt-interval", help="checkpoint interval minimising expected lost time per hour")
    i.add_argument("--stall", type=float, help="seconds a save blocks training")
    i.add_argument("--total", type=float, help="seconds from save start to durable")
    i.add_argument("--checkpoint", help="take --stall / --total from this checkpoint's recorded save")
    i.add_argument("--iter", type=float, help="seconds per training step")
    i.add_argument("--restore", type=float, help="seconds to restart and load (default: --total)")
    i.add_argument("--mtbf-hours", type=float, default=24.0, help="mean time between failures of the job")
    i.set_defaults(func=cmd_interval)
