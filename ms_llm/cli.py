"""`ms-llm` entry point. Each subcommand is a small function; user errors print one line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ms_llm.errors import MsLlmError


def _load_plan(args):
    from ms_llm.job import load_job
    from ms_llm.strategy.cost import estimate
    from ms_llm.strategy.devices import get_device
    from ms_llm.strategy.plan import plan

    job = load_job(args.config)
    device = get_device(args.device or job.device)
    p = plan(job.model, job.strategy, job.train, args.world_size)
    return job, p, estimate(p, device), device


def cmd_plan(args) -> int:
    """The plan report, then the backend's ZeRO engine and refusals on the plan's device's
    accelerator; exit status 2 when the backend refuses the plan."""
    from ms_llm.backends import verdict
    from ms_llm.machine import Machine
    from ms_llm.strategy.report import plan_json, plan_report

    job, p, est, device = _load_plan(args)
    answer = verdict(args.backend or job.backend, p, Machine.running(device))
    if args.json:
        print(json.dumps({**plan_json(p, est, device), "backend": answer.to_json()}, indent=2))
    else:
        print(plan_report(p, est, device))
        print()
        print("\n".join(answer.lines()))
    if answer.runs:
        return 0
    print(f"ms-llm plan: {answer.backend} cannot run this plan on {answer.machine.accelerator} "
          f"({len(answer.refusals)} refusal(s), listed above)", file=sys.stderr)
    return 2


def cmd_train(args) -> int:
    from ms_llm.launch import TrainRequest, train
    from ms_llm.nodes import Nodes

    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    return train(TrainRequest(Path(args.config), args.backend, args.nproc, args.run_dir, args.steps, args.dry_run,
                              args.max_restarts if args.max_restarts is not None else 0, nodes,
                              elastic_options(args)))


def elastic_options(args):
    """--elastic and its flags, checked; None without --elastic."""
    from ms_llm.elastic.supervisor import ElasticOptions
    from ms_llm.elastic.watch import Timeouts
    from ms_llm.errors import ConfigError

    if not args.elastic:
        for flag, value in (("--min-ranks", args.min_ranks), ("--hang-timeout", args.hang_timeout)):
            if value is not None:
                raise ConfigError(f"{flag}: only used with --elastic")
        return None
    if args.min_ranks is not None and args.min_ranks < 1:
        raise ConfigError(f"--min-ranks: got {args.min_ranks}; give the smallest world to shrink to, 1 or more")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise ConfigError(f"--hang-timeout: got {args.hang_timeout}; give seconds without progress, more than 0")
    return ElasticOptions(max_restarts=3 if args.max_restarts is None else args.max_restarts,
                          min_ranks=args.min_ranks, timeouts=Timeouts(hang_s=args.hang_timeout))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ms-llm", description="Pretrain LLaMA-family models on Ascend "
                                     "(MindSpore) and GPU (PyTorch) from one parallel-strategy IR.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="validate a job and print mesh, memory, communication and time per rank")
    p.add_argument("config", help="job YAML (model + strategy + train)")
    p.add_argument("--world-size", type=int, default=None, help="devices; default: from the strategy")
    p.add_argument("--device", default=None, help="h100, h200, a100, 910b or cpu; default: the job's device")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--backend", choices=("torch", "mindspore"), default=None,
                   help="report this backend's ZeRO engine and every refusal on the device's accelerator (exit "
                        "status 2 when refused); default: the job's backend")
    p.set_defaults(func=cmd_plan)

    t = sub.add_parser("train", help="train a job: resolve it into the run folder, start its workers on this "
                                     "machine (several machines: the same command on each, with --nnodes)")
    t.add_argument("config", help="job YAML (model + strategy + train)")
    t.add_argument("--backend", choices=("torch", "mindspore"), default=None, help="default: the job's backend")
    t.add_argument("--nproc", type=int, default=None,
                   help="processes over all nodes (the world size); default: the strategy's")
    t.add_argument("--run-dir", default=None,
                   help="run folder; default: runs/<name>-<time> (required with --nnodes 2 or more)")
    t.add_argument("--steps", type=int, default=None, help="override train.steps")
    t.add_argument("--dry-run", action="store_true",
                   help="print the lowering (MindSpore: parallel context and every op's strategy) without compiling")
    t.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="start the workers again after a failure, up to N times (default 0; 3 with --elastic); "
                        "each restart resumes from the run folder's newest checkpoint (needs "
                        "train.checkpoint.interval)")
    t.add_argument("--elastic", action="store_true",
                   help="a supervisor owns the job: detects dead and hung ranks (heartbeats), stops every worker, "
                        "does not retry failures that would repeat, shrinks or grows dp, resumes (ms_llm.elastic)")
    t.add_argument("--min-ranks", type=int, default=None, metavar="N",
                   help="with --elastic: the smallest world to shrink to (default 1: tp/pp/cp are kept while "
                        "they fit, the strategy search re-plans below that)")
    t.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                   help="with --elastic: seconds without a step before a rank counts as hung (default: 10x the "
                        "measured step time, at least 30)")
    t.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="machines in the job; each runs world size / N processes")
    t.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this machine's place, 0 to N-1; node 0 hosts the rendezvous at --master-addr")
    t.add_argument("--master-addr", default=None, metavar="HOST", help="node 0's address (with --nnodes 2 or more)")
    t.add_argument("--master-port", type=int, default=None, metavar="P",
                   help="a free port on node 0, the same on every node (with --nnodes 2 or more)")
    t.set_defaults(func=cmd_train)

    from ms_llm.commands import checkpoint, clean, convert, demo, estimate, interval, prepare_data, report, search
    for name, module, summary in (
            ("convert-strategy", convert, "convert strategy configs between Megatron-LM, DeepSpeed, MindFormers, "
                                          "torchtitan and ms_llm"),
            ("estimate", estimate, "per-device memory breakdown and step time of one or more strategies"),
            ("search", search, "search parallel strategies with the cost model and rank them"),
            ("convert-checkpoint", checkpoint, "export / import Hugging Face, MindSpore, DCP; reshard"),
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
