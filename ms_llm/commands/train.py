"""Train a job: resolve it once (overrides, paths, dp and micro-batches for the world size, the
backend's verdict) into <run>/config.yaml, then start this machine's workers from that folder.
Several machines: the same command on each, with --nnodes, --node-rank, --master-addr,
--master-port and one --run-dir.

examples:
  ms-llm train configs/train/tiny_torch_dp2.yaml
  ms-llm train configs/train/tiny_torch_dp2.yaml --set train.steps=100 --set strategy.zero.stage=1
  ms-llm train configs/train/tiny_torch_dp2.yaml --backend torch --dry-run
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ms_llm.commands import add_job_arguments, job_overrides
from ms_llm.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument("--backend", choices=("torch", "mindspore"), default=None, help="default: the job's backend")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes over all nodes (the world size); default: the strategy's")
    parser.add_argument("--run-dir", default=None,
                        help="run folder; default: runs/<name>-<time> (required with --nnodes 2 or more)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the lowering (MindSpore: parallel context and every op's strategy) without "
                             "compiling")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="N",
                        help="start the workers again after a failure, up to N times (default 0; 3 with --elastic); "
                             "each restart resumes from the run folder's newest checkpoint (needs "
                             "train.checkpoint.interval)")
    parser.add_argument("--elastic", action="store_true",
                        help="a supervisor owns the job: detects dead and hung ranks (heartbeats), stops every "
                             "worker, does not retry failures that would repeat, shrinks or grows dp, resumes "
                             "(ms_llm.elastic)")
    parser.add_argument("--min-ranks", type=int, default=None, metavar="N",
                        help="with --elastic: the smallest world to shrink to (default 1: tp/pp/cp are kept while "
                             "they fit, the strategy search re-plans below that)")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                        help="with --elastic: seconds without a step before a rank counts as hung (default: 10x the "
                             "measured step time, at least 30)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="machines in the job; each runs world size / N processes")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="this machine's place, 0 to N-1; node 0 hosts the rendezvous at --master-addr")
    parser.add_argument("--master-addr", default=None, metavar="HOST",
                        help="node 0's address (with --nnodes 2 or more)")
    parser.add_argument("--master-port", type=int, default=None, metavar="P",
                        help="a free port on node 0, the same on every node (with --nnodes 2 or more)")


def run(args: argparse.Namespace) -> int:
    from ms_llm.launch import TrainRequest, train
    from ms_llm.nodes import Nodes

    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    return train(TrainRequest(Path(args.config), args.backend, args.nproc, args.run_dir, args.steps, args.dry_run,
                              args.max_restarts if args.max_restarts is not None else 0, nodes,
                              elastic_options(args), job_overrides(args)))


def elastic_options(args: argparse.Namespace):
    """--elastic and its flags, checked; None without --elastic."""
    from ms_llm.elastic.supervisor import ElasticOptions
    from ms_llm.elastic.watch import Timeouts

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
