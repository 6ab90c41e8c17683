"""Convert checkpoints between ms_llm, Hugging Face, MindSpore (per-rank .ckpt + strategy files)
and torch DCP folders, and reshard ms_llm checkpoints to another strategy or world size.

Any pair not involving ms_llm goes through a temporary ms_llm checkpoint. Framework code is
imported only by the branch that needs it (torch for DCP, MindSpore for MindSpore).

examples:
  ms-llm convert-checkpoint SRC DST --to hf
  ms-llm convert-checkpoint SRC DST --to hf --drop-mtp                     # without the MTP modules
  ms-llm convert-checkpoint HF_DIR DST --from hf
  ms-llm convert-checkpoint SRC DST --to mindspore --strategy tp2 --world-size 4
  ms-llm convert-checkpoint SRC DST --strategy dp2 --world-size 2          # reshard
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ms_llm.checkpoint.interop.hf import export_hf, import_hf
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.reshard import layout_plan, reshard
from ms_llm.checkpoint.storage.commit import step_dir
from ms_llm.errors import CheckpointError, ConfigError
from ms_llm.job import load_section

FORMATS = ("ms_llm", "hf", "mindspore", "dcp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source folder (an ms_llm checkpoint root or step folder, or a foreign folder)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--from", dest="src_format", choices=FORMATS, default="ms_llm")
    parser.add_argument("--to", choices=FORMATS, default="ms_llm")
    parser.add_argument("--strategy", help="strategy YAML or name: the layout to write (MindSpore export, reshard)")
    parser.add_argument("--world-size", type=int, default=None, help="world size for --strategy")
    parser.add_argument("--model", help="model YAML or name (imports from DCP / MindSpore carry no model config)")
    parser.add_argument("--ms-strategy", help="MindSpore strategy file, or folder of rank_<r>.ckpt strategy files")
    parser.add_argument("--names", choices=("hf", "torchtitan"), default="hf", help="DCP tensor names")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="Hugging Face export dtype")
    parser.add_argument("--drop-mtp", action="store_true",
                        help="Hugging Face export: leave DeepSeek's multi-token prediction modules out (kept by default, "
                             "as model.layers.{num_layers + d}.*)")
    parser.add_argument("--step", type=int, default=0, help="step recorded for imported checkpoints")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what DST already holds (the same checkpoint step, or a non-empty export folder)")


def run(args: argparse.Namespace) -> int:
    """Convert; a folder the operating system refuses (missing, read-only, full) is one line."""
    src, dst = Path(args.src), Path(args.dst)
    try:
        if not args.overwrite:
            _refuse_overwrite(args, src, dst)
        out = _convert(args, src, dst)
    except OSError as exc:
        raise CheckpointError(f"convert-checkpoint: {exc.filename or args.dst}: {exc.strerror or exc}") from None
    print(_wrote(args, out))
    return 0


def _refuse_overwrite(args: argparse.Namespace, src: Path, dst: Path) -> None:
    """Nothing already saved is replaced without --overwrite: the same step of an ms_llm
    checkpoint root, or a foreign-format folder that is not empty."""
    if args.to == "ms_llm":
        step = args.step if args.src_format != "ms_llm" else Checkpoint.open(src).step
        if step_dir(dst, step).exists():
            raise CheckpointError(f"convert-checkpoint: {dst} already holds step {step} ({step_dir(dst, step)}); "
                                  f"pass --overwrite to replace it, or write to another folder"
                                  + (" or --step" if args.src_format != "ms_llm" else ""))
    elif dst.is_dir() and any(dst.iterdir()):
        raise CheckpointError(f"convert-checkpoint: {dst} is not empty; pass --overwrite to write the "
                              f"{args.to} export over it, or choose an empty folder")


def _wrote(args: argparse.Namespace, out: Path) -> str:
    """What was written: the format, the step and the files, so an export is checkable at a glance."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    shown = ", ".join(str(p.relative_to(out)) for p in files[:4]) + (", ..." if len(files) > 4 else "")
    step = Checkpoint.open(out).step if args.to == "ms_llm" else (
        args.step if args.src_format != "ms_llm" else Checkpoint.open(Path(args.src)).step)
    return f"wrote {out}: {args.to} format, step {step}, {len(files)} files, {size / 1e6:.1f} MB ({shown})"


def _convert(args: argparse.Namespace, src: Path, dst: Path) -> Path:
    if args.src_format == "ms_llm":
        out = _export(args, args.to, src, dst)
    elif args.to == "ms_llm" and args.strategy is None:
        out = _import(args, args.src_format, src, dst)
    else:                                        # through a temporary ms_llm checkpoint
        dst.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
            mid = _import(args, args.src_format, src, Path(tmp))
            out = _export(args, args.to, mid, dst)
    return out


def _section(kind: str, value: str | None, flag: str):
    if value is None:
        raise ConfigError(f"convert-checkpoint: {flag} is required for this conversion")
    return load_section(kind, value)


def _target(args: argparse.Namespace, src: Path):
    """The ModelPlan the output is laid out for (--strategy, --world-size)."""
    strategy = _section("strategy", args.strategy, "--strategy")
    model = _section("model", args.model, "--model") if args.model else Checkpoint.open(src).model_config()
    return layout_plan(model, strategy, args.world_size)


def _import(args: argparse.Namespace, fmt: str, src: Path, dst: Path) -> Path:
    if fmt == "hf":
        return import_hf(src, dst)
    model = _section("model", args.model, "--model")
    if fmt == "dcp":
        from torch_backend.dcp import import_dcp
        return import_dcp(src, dst, model, names=args.names, step=args.step)
    from ms_llm.mindspore.checkpoint import import_mindspore
    if args.ms_strategy is None:
        raise ConfigError("convert-checkpoint: --ms-strategy (a strategy file or a folder of rank_<r>.ckpt "
                          "strategy files) is required to import MindSpore checkpoints")
    return import_mindspore(src, Path(args.ms_strategy), dst, model, step=args.step)


def _export(args: argparse.Namespace, fmt: str, src: Path, dst: Path) -> Path:
    if fmt == "hf":
        return export_hf(src, dst, dtype=args.dtype, mtp=not args.drop_mtp)
    if fmt == "dcp":
        from torch_backend.dcp import export_dcp
        return export_dcp(src, dst, names=args.names)
    if fmt == "mindspore":
        from ms_llm.mindspore.checkpoint import export_mindspore
        return export_mindspore(src, dst, _target(args, src))
    return reshard(src, dst, _target(args, src))
