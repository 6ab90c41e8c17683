"""Convert a parallel-strategy config between Megatron-LM (launch script or argument list),
DeepSpeed JSON, MindFormers YAML (read: r1.x, 2.x and pynative layouts; write: --to mindformers for r1.x,
--to mindformers2 for 2.x with use_legacy: False), torchtitan (read: 0.3 jobs, a registered --module /
--config plus command-line overrides, and v0.2.x TOML; write: --to torchtitan for a 0.3 launch script,
--to torchtitan_toml or an --output ending in .toml for v0.2.x TOML) and ms_llm job YAML.

The conversion goes through ms_llm's strategy IR and is validated on the way. Everything the
source says that the IR does not model, and everything the target cannot express, is listed as a
warning on stderr; --strict makes any of them an error.

examples:
  ms-llm convert-strategy pretrain_llama2_70b.yaml --to megatron -o train_llama2_70b.sh
  ms-llm convert-strategy pretrain_qwen3_32b_4k.yaml --to ms_llm -o qwen3_32b.yaml
  ms-llm convert-strategy ds_config.json --model llama2_7b --world-size 64 --to torchtitan -o run_llama2.sh
  ms-llm convert-strategy job.yaml -o llama3_8b.toml                  # torchtitan v0.2.x TOML
  ms-llm convert-strategy llama3_8b.toml --world-size 64 --to ms_llm
"""
from __future__ import annotations

import argparse
import sys

from ms_llm.commands import add_input_arguments, read_options, write_output
from ms_llm.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ms_llm.convert import FORMATS
    parser.add_argument("input", help="strategy file to convert ('-' reads standard input)")
    parser.add_argument("--to", dest="target_format", choices=FORMATS, default=None,
                        help="output format; default: from the --output suffix (.sh: megatron, .json: deepspeed, "
                             ".toml: torchtitan_toml)")
    parser.add_argument("-o", "--output", default=None, help="write here instead of standard output")
    parser.add_argument("--strict", action="store_true",
                        help="fail instead of warning when anything would not carry over")
    add_input_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ms_llm.convert import convert, format_for_output
    target = args.target_format or (format_for_output(args.output) if args.output else None)
    if target is None:
        raise ConfigError("--to: give the output format (ms_llm, megatron, deepspeed, mindformers, mindformers2, "
                          "torchtitan, torchtitan_toml) or an --output file ending in .sh, .json or .toml")
    text, warnings = convert(args.input, target, args.source_format, read_options(args), strict=args.strict)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.output:
        write_output(args.output, text)
        print(f"wrote {args.output} ({target}); {len(warnings)} warning(s)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
