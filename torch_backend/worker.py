"""Worker entry point: one process of a training job.

    torchrun --nproc-per-node 8 -m torch_backend.worker CONFIG.yaml --run-dir runs/x
    python -m torch_backend.worker CONFIG.yaml --run-dir runs/x       # a world of one

`ms-llm train CONFIG.yaml --backend torch` launches torchrun with this module itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ms_llm.config.job import load_job
from ms_llm.errors import MsLlmError
from ms_llm.run import RunFolder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_backend.worker", description=__doc__.splitlines()[0])
    p.add_argument("config", help="job YAML (model + strategy + train)")
    p.add_argument("--run-dir", required=True, help="run folder shared by all workers")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = load_job(args.config)
        if args.steps is not None:
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=args.steps))
    except MsLlmError as exc:
        print(f"torch_backend.worker: error: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from torch_backend.dist import init_distributed, shutdown
    from torch_backend.train import train

    device = init_distributed()
    rank = dist.get_rank()
    try:
        history = train(job, RunFolder.create(job.name, args.run_dir), device)
    except MsLlmError as exc:           # raised alike on every rank (plan / config problems)
        shutdown()
        print(f"torch_backend.worker: error: {exc}", file=sys.stderr)
        return 2
    shutdown()
    if rank == 0 and history:
        first, last = history[0], history[-1]
        print(f"done: {len(history)} steps, loss {first.loss:.4f} -> {last.loss:.4f}, "
              f"{sum(m.step_time_s for m in history):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Every file and process group is closed by now. Skipping interpreter teardown keeps
    # gloo's threads from aborting a finished run while Python finalizes (seen once:
    # "terminate called without an active exception" after the last step).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
