"""Subcommands shared by `ms-llm` and the scripts in tools/: each module has `add_arguments(parser)`
and `run(args) -> int`, so `ms-llm convert-strategy ...` and `python tools/convert_strategy.py ...`
are the same parser and the same code."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

from ms_llm.errors import ConfigError, MsLlmError


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every command that reads a strategy file takes."""
    from ms_llm.convert import FORMATS
    parser.add_argument("--from", dest="source_format", choices=FORMATS, default=None,
                        help="input format; default: from the file's suffix and content")
    parser.add_argument("--world-size", type=int, default=None,
                        help="devices; default: what the input implies (needed for dp = -1 / dp_shard = -1 inputs)")
    parser.add_argument("--model", default=None,
                        help="model shape (a name in configs/models, e.g. llama2_7b, or a model YAML) for inputs "
                             "that hold none: DeepSpeed configs, torchtitan flavors ms_llm does not ship")
    parser.add_argument("--device", default=None, help="h100, h200, a100, 910b or cpu; default: the input's device")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job YAML and the command-line changes to it that `plan` and `train` take alike, so a
    change is checked with `plan` exactly as `train` will run it."""
    parser.add_argument("config", help="job YAML (model + strategy + train)")
    parser.add_argument("--set", dest="set", action="append", default=[], metavar="PATH=VALUE",
                        help="change one key of the job before it is checked, e.g. train.steps=100 or "
                             "strategy.zero.stage=2 (VALUE read as YAML: 2, 0.5, true, [1, 2]); repeatable")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="model shape (a name in configs/models, e.g. llama2_7b, or a model YAML) for a job "
                             "that names none, or in place of its own")


def job_overrides(args: argparse.Namespace):
    """The Overrides that add_job_arguments' flags ask for, checked."""
    from ms_llm.job import parse_overrides
    return parse_overrides(args.set, args.model)


def read_options(args: argparse.Namespace):
    from ms_llm.job import load_section
    from ms_llm.convert import ReadOptions
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size: got {args.world_size}; need at least 1 device")
    model = load_section("model", args.model) if args.model else None
    return ReadOptions(world_size=args.world_size, model=model, device=args.device)


def write_output(path: str, text: str, flag: str = "--output") -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write {path} ({exc.strerror})") from None


def table(headers: list[str], rows: list[list[object]], left: int = 1) -> str:
    """Plain-text table; the first `left` columns are left-aligned, the rest right-aligned."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(line.rstrip() for line in lines)


def tool_main(module: ModuleType, prog: str, argv: list[str] | None = None) -> int:
    """Entry point of a tools/ script: the subcommand's parser, user errors as one line."""
    parser = argparse.ArgumentParser(prog=prog, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return module.run(args)
    except MsLlmError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
