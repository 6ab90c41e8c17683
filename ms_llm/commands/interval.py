"""The checkpoint interval that minimises expected lost time per hour: the time saves stall
training against the work a failure throws away (Young/Daly), from measured save timings.

examples:
  ms-llm ckpt-interval --checkpoint runs/job/checkpoints --iter 1.2 --mtbf-hours 12
  ms-llm ckpt-interval --stall 2 --total 30 --iter 1.2
"""
from __future__ import annotations

import argparse

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.errors import ConfigError
from ms_llm.run.interval import IntervalInputs, choose_interval


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stall", type=float, help="seconds a save blocks training")
    parser.add_argument("--total", type=float, help="seconds from save start to durable")
    parser.add_argument("--checkpoint", help="take --stall / --total from this checkpoint's recorded save")
    parser.add_argument("--iter", type=float, help="seconds per training step")
    parser.add_argument("--restore", type=float, help="seconds to restart and load (default: --total)")
    parser.add_argument("--mtbf-hours", type=float, default=24.0, help="mean time between failures of the job")


def run(args: argparse.Namespace) -> int:
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
