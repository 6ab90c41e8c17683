"""One process of a torch training job: plan, lower, then the shared loop (ms_llm.run.loop).

    torchrun ... -m torch_backend.worker --run-dir RUN

`ms-llm train` resolves the job once and writes RUN/config.yaml; a worker starts from that
folder alone.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from ms_llm.errors import MsLlmError, TrainingDiverged
from ms_llm.job import load_job
from ms_llm.run import RunFolder
from ms_llm.run.loop import DIVERGED_EXIT


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_backend.worker", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="run folder written by `ms-llm train` (holds config.yaml)")
    return p.parse_args(argv)


def build_trainer(run: RunFolder, device):
    """This rank's model, lowered from the plan, and its step function, for the shared loop."""
    import torch
    import torch.distributed as dist

    from ms_llm.machine import Machine
    from ms_llm.run import peak_rss_gb
    from ms_llm.run.loop import Trainer
    from ms_llm.run.metrics import max_expert_load
    from ms_llm.run.memory import limit_host_memory, out_of_memory_error
    from ms_llm.strategy.plan import plan as make_plan
    from torch_backend.apply import apply
    from torch_backend.lower import lower
    from torch_backend.mesh import build_meshes
    from torch_backend.state import TorchTrainerState
    from torch_backend.step import TrainStep

    job = load_job(run.config)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = make_plan(job.model, job.strategy, job.train, world)     # checks the world size too
    # Lower the plan (pure data: mesh, pipeline chunks, TP/SP styles, AC, engine, schedule), then
    # build it on this rank (torch_backend/parallelize, in its fixed order).
    low = lower(plan, Machine("cuda" if device.type == "cuda" else "cpu"))
    lowered = apply(low, plan, build_meshes(low.mesh, device.type, low.expert_mesh), device, rank)
    limit = job.train.memory_limit_gb
    if limit and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit * 2**30 / total), device)
    elif limit:
        limit_host_memory(limit)        # the model is built: from here gradients, optimizer state, steps count
    step_fn = TrainStep(lowered)
    if rank == 0:
        print(f"lowered: {plan.mesh.describe()} | data parallel: {lowered.dp.name} (ZeRO {plan.zero.stage}) | "
              f"{plan.micro_batches} micro-batch(es) | precision {plan.strategy.precision.compute_dtype} | "
              f"device {device}", flush=True)

    def step(i: int, rows, before_update: Callable[[], None]) -> tuple[float, float]:
        with out_of_memory_error(limit, rank, i):
            loss, grad_norm = step_fn(i, torch.from_numpy(rows), before_update)
            return loss.item(), grad_norm.item()              # waits for the step

    def memory_gb() -> float:
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else peak_rss_gb()

    def evaluate(rows) -> float:
        return step_fn.evaluate(torch.from_numpy(rows)).item()

    def reported() -> dict[str, float]:
        out = {}
        if step_fn.mtp_loss is not None:
            out["mtp_loss"] = step_fn.mtp_loss.item()
        if step_fn.expert_loads is not None:
            out["max_expert_load"] = max_expert_load(step_fn.expert_loads.cpu().numpy())
        return out

    return Trainer(job, run, plan, rank, step, TorchTrainerState(step_fn, plan, rank), memory_gb, logs=rank == 0,
                   loss_scale=step_fn.loss_scale, evaluate=evaluate, reported=reported)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = RunFolder(Path(args.run_dir).resolve())
    if not run.config.is_file():
        print(f"torch_backend.worker: error: {run.config} does not exist; start workers with `ms-llm train`",
              file=sys.stderr)
        return 2
    from ms_llm.nodes import exit_with_supervisor, wait_for_gate

    exit_with_supervisor()
    import torch.distributed as dist

    import torch_backend.apply  # noqa: F401  (a standby worker imports everything before its gate)
    from ms_llm.run.loop import train
    from torch_backend.dist import init_distributed, shutdown

    if not wait_for_gate():
        return 0
    device = init_distributed()
    rank = dist.get_rank()
    try:
        train(build_trainer(run, device))
    except TrainingDiverged as exc:     # every rank sees the same global loss and norm
        shutdown()
        print(f"torch_backend.worker: {exc}", file=sys.stderr)
        return DIVERGED_EXIT
    except MsLlmError as exc:
        # No shutdown barrier: the error may be this rank's alone (a checkpoint write on a full
        # disk), and peers busy elsewhere would hold this rank at the barrier. Exiting lets the
        # launcher stop them.
        print(f"torch_backend.worker: error: {exc}", file=sys.stderr)
        return 2
    shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # Every file and process group is closed by now. Skipping interpreter teardown keeps
    # gloo's threads from aborting a finished run while Python finalizes (seen once:
    # "terminate called without an active exception" after the last step).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
