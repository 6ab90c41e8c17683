"""Search every valid parallel strategy of a model on N devices with ms_llm's cost model: data
parallel x ZeRO stage x tensor parallel (+ sequence parallel) x pipeline parallel (1F1B or
interleaved, virtual stages) x micro-batch size x context parallel x recompute. Strategies that do
not fit in device memory are dropped; the rest are ranked by estimated step time. Prints the
top-k and writes the best as an ms_llm job (or any format convert-strategy writes).

The model and batch come from an input file in any supported format, or from --model with
--global-batch-size; an input's precision, offload and expert-parallel settings are kept.

examples:
  ms-llm search --model llama2_70b --world-size 1024 --device h100 --global-batch-size 1024 --seq-len 4096
  ms-llm search pretrain_llama2_70b.yaml --compare pretrain_llama2_70b.yaml -o best.sh --to megatron
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ms_llm.commands import add_input_arguments, read_options, write_output, table
from ms_llm.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ms_llm.convert import FORMATS
    parser.add_argument("input", nargs="?", default=None,
                        help="a job / strategy file giving the model, batch and precision (optional with --model)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: the input's)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the input's, "
                                                                  "else the model's max_seq_len)")
    parser.add_argument("--top", type=int, default=5, help="rows to print (default 5)")
    parser.add_argument("--max-tp", type=int, default=0, help="largest tensor-parallel degree (default: a node)")
    parser.add_argument("--max-cp", type=int, default=8, help="largest context-parallel degree (default 8)")
    parser.add_argument("--micro-batch-sizes", default="1,2,4", help="micro-batch sizes to try (default 1,2,4)")
    parser.add_argument("--schedules", default="1f1b,interleaved_1f1b",
                        help="pipeline schedules to try (default 1f1b,interleaved_1f1b; also gpipe, zero_bubble, zbv)")
    parser.add_argument("--compare", default=None, metavar="FILE",
                        help="also price this strategy (any format) and show where it ranks")
    parser.add_argument("-o", "--output", default=None, help="write the best strategy here")
    parser.add_argument("--to", dest="target_format", choices=FORMATS, default=None,
                        help="format of --output (default: from its suffix, else ms_llm)")
    add_input_arguments(parser)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag}: expected positive integers, got {text!r}")
    return values


def _problem(args: argparse.Namespace):
    """(model, train, base strategy, world size, device name) from the input and the flags."""
    from ms_llm.job import load_section
    from ms_llm.config.train import TrainConfig
    from ms_llm.convert import load
    from ms_llm.strategy.ir import ParallelStrategy
    if args.input:
        conv = load(args.input, args.source_format, read_options(args))
        model, train, base = conv.job.model, conv.job.train, conv.job.strategy
        world, device = args.world_size or conv.world_size, args.device or conv.job.device
    elif args.model:
        model = load_section("model", args.model)
        if args.global_batch_size is None:
            raise ConfigError("--global-batch-size: needed when no input file gives the batch")
        train, base, world, device = TrainConfig(seq_len=model.max_seq_len), ParallelStrategy(), args.world_size, \
            args.device or "h100"
    else:
        raise ConfigError("give an input file (model, batch, precision) or --model NAME with --global-batch-size")
    if not world:
        raise ConfigError("--world-size: needed (the number of devices to search over)")
    changes = {}
    if args.global_batch_size is not None:
        changes["global_batch_size"] = args.global_batch_size
    if args.seq_len is not None:
        changes["seq_len"] = args.seq_len
    return model, dataclasses.replace(train, **changes), base, world, device


def run(args: argparse.Namespace) -> int:
    from ms_llm.job import JobConfig
    from ms_llm.convert import dump, format_for_output, from_job, load
    from ms_llm.strategy.devices import get_device
    from ms_llm.strategy.report import model_params_text
    from ms_llm.strategy.search import SearchSpace, price, search
    model, train, base, world, device_name = _problem(args)
    device = get_device(device_name)
    space = SearchSpace(max_tp=args.max_tp, max_cp=args.max_cp,
                        micro_batch_sizes=_ints(args.micro_batch_sizes, "--micro-batch-sizes"),
                        schedules=tuple(s.strip() for s in args.schedules.split(",") if s.strip()))
    result = search(model, train, world, device, base, space)
    print(f"ms-llm search: {model.name} ({model_params_text(model)}) on {world} x {device.name}; "
          f"global batch {train.global_batch_size} x {train.seq_len} tokens")
    print(f"searched {result.enumerated} strategies ({result.priced} priced) in {result.seconds:.2f} s: "
          f"{result.invalid} invalid, {result.too_big} do not fit in {device.memory_bytes / 1e9:.0f} GB, "
          f"{len(result.ranked)} fit")
    if not result.ranked:
        print("no strategy fits: use more devices, a smaller micro batch / sequence, or offload")
        return 1
    rows = [_row(str(i + 1), c) for i, c in enumerate(result.ranked[:args.top])]
    if args.compare:
        conv = load(args.compare, None, read_options(args))
        ref = price(conv.job.model, conv.job.strategy, conv.job.train, device, conv.world_size)
        rank = result.rank_of(ref) if ref.estimate.fits else "-"
        rows.append(_row(f"{Path(args.compare).stem} (#{rank})", ref))
    print(table(["#", "dp", "zero", "tp", "sp", "pp", "vpp", "mb", "mbs", "cp", "recompute", "mem GB", "step s",
                 "MFU", "tok/s/dev"], rows))
    if args.compare:
        best = result.ranked[0].estimate.step_s
        print(f"{Path(args.compare).stem}: rank {rank} of {len(result.ranked)}, "
              f"step {ref.estimate.step_s / best:.3f}x the best{'' if ref.estimate.fits else ' (does not fit)'}")
    if args.output:
        best = result.ranked[0]
        job = JobConfig(name=f"{model.name}_{world}x{device_name}", device=device_name, model=model,
                        strategy=best.strategy, train=best.train)
        target = args.target_format or format_for_output(args.output) or "ms_llm"
        out = dump(from_job(job, world, "search"), target)
        for w in out.warnings:
            print(f"warning: {w}", file=sys.stderr)
        write_output(args.output, out.text)
        print(f"wrote the best strategy to {args.output} ({target})")
    return 0


def _row(label: str, c) -> list[object]:
    from ms_llm.strategy.search import describe
    d = describe(c.strategy)
    e = c.estimate
    return [label, d["dp"], d["zero"], d["tp"], d["sp"], d["pp"], d["vpp"], d["mb"], c.train.micro_batch_size,
            d["cp"], d["recompute"], f"{e.memory.total / 1e9:.1f}", f"{e.step_s:.3f}", f"{100 * e.mfu:.1f}%",
            f"{e.tokens_per_s_per_device:,.0f}"]
