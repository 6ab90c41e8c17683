"""Check a checkpoint before relying on it: `ms-llm checkpoint verify` reads what a resume of every
rank reads (the head, every index part, every shard's safetensors header and checksum blocks, the
training state and each rank's own state) and says OK in one line (exit 0), or prints one line
per problem (exit 2). DIR is a step folder, or a checkpoint root: its `latest` step, or --step N.

examples:
  ms-llm checkpoint verify runs/tiny/checkpoints
  ms-llm checkpoint verify runs/tiny/checkpoints --step 200
  ms-llm checkpoint verify runs/tiny/checkpoints/step_00000200
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.checkpoint.storage.commit import committed, step_dir
from ms_llm.checkpoint.storage.format import INDEX
from ms_llm.errors import CheckpointError
from ms_llm.run.saved_state import check_saved_state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    verify = sub.add_parser("verify", help="read a checkpoint as every rank's resume would; OK or its problems",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("dir", type=Path, help="a checkpoint root (e.g. runs/NAME/checkpoints) or a step folder")
    verify.add_argument("--step", type=int, default=None, help="the step to check under a root; default: `latest`")


def run(args: argparse.Namespace) -> int:
    with Checkpoint.open(args.dir) if args.step is None else Checkpoint(_step_folder(args.dir, args.step)) as ckpt:
        problems = ckpt.problems()
        try:
            check_saved_state(ckpt.state, ckpt.rank_states(), ckpt.step, str(ckpt.folder / INDEX))
        except CheckpointError as exc:
            problems.append(str(exc))
        if problems:
            for problem in problems:
                print(f"ms-llm checkpoint verify: {problem}", file=sys.stderr)
            return 2
        shards = [(s, ckpt.entry(n).itemsize) for n in ckpt.names() for s in ckpt.entry(n).shards]
        size = sum(s.region.numel * itemsize for s, itemsize in shards)
        parts = len(ckpt.index.parts.records) if ckpt.index.parts is not None else 0
        print(f"OK: {ckpt.folder}: step {ckpt.step}, {len(ckpt.names())} tensors in {len(shards)} shards "
              f"({size / 1e6:.1f} MB), {parts} index parts, every checksum matches, training state usable")
    return 0


def _step_folder(path: Path, step: int) -> Path:
    """Step `step`'s committed folder under the root `path`."""
    folder = step_dir(path, step)
    if not (folder / INDEX).is_file():
        steps = ", ".join(str(int(f.name[5:])) for f in reversed(committed(path)))
        raise CheckpointError(f"{path}: no committed checkpoint of step {step} ({folder}); it holds "
                              f"{'steps ' + steps if steps else 'none'}")
    return folder
