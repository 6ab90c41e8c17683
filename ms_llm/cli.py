"""`ms-llm` entry point: dispatches to the subcommands in ms_llm/commands; user errors print one line."""
from __future__ import annotations

import argparse
import os
import sys

from ms_llm.errors import MsLlmError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-llm", description="Pretrain decoder LLMs (LLaMA, Qwen, "
                                     "Mixtral-style MoE) on Ascend (MindSpore) and GPU (PyTorch) from one "
                                     "parallel-strategy IR.")
    sub = parser.add_subparsers(dest="command", required=True)

    from ms_llm.commands import (checkpoint, clean, convert, demo, estimate, export_run, import_run, interval, plan,
                                 prepare_data, report, search, train, verify)
    for name, module, summary in (
            ("plan", plan, "validate a job and print mesh, memory, communication and time per rank"),
            ("train", train, "train a job: resolve it into the run folder, start its workers on this machine "
                             "(several machines: the same command on each, with --nnodes)"),
            ("convert-strategy", convert, "convert strategy configs between Megatron-LM, DeepSpeed, MindFormers, "
                                          "torchtitan and ms_llm"),
            ("estimate", estimate, "per-device memory breakdown and step time of one or more strategies"),
            ("search", search, "search parallel strategies with the cost model and rank them"),
            ("convert-checkpoint", checkpoint, "export / import Hugging Face, MindSpore, DCP; reshard"),
            ("import-run", import_run, "continue a Megatron-LM, DeepSpeed, torchtitan or MindFormers run: its "
                                       "checkpoint and config as an ms_llm checkpoint and job"),
            ("export-run", export_run, "an ms_llm checkpoint as a run the peer's trainer continues, or HF weights"),
            ("checkpoint", verify, "checkpoint verify DIR [--step N]: read a checkpoint as every rank's resume would"),
            ("ckpt-interval", interval, "checkpoint interval minimising expected lost time per hour"),
            ("prepare-data", prepare_data, "tokenize text (JSONL, text, Parquet, HF datasets, MindRecord) into an "
                                           "indexed dataset; train a BPE tokenizer"),
            ("report", report, "loss and throughput plots and summary.md of one or more run folders"),
            ("clean", clean, "free a run's memory-tier snapshot in /dev/shm and remove half-written checkpoints"),
            ("demo", demo, "the mission in a few minutes on CPU: plan, convert, train under several strategies, "
                           "recover from a lost rank, continue on MindSpore, export to Hugging Face, report")):
        c = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(c)
        c.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MsLlmError as exc:
        print(f"ms-llm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`ms-llm plan ... | head`): stop quietly, as other Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
