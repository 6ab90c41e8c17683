"""The torch trainer (TrainStep over the lowering) with train.optimizer.weight_decay_1d false, for
tests/torch/test_torch_weight_decay.py: in that process at world 1, and under torchrun at world 2

    torchrun --nproc-per-node 2 tests/helpers/decay_torch_worker.py OUT case [case ...]

where each case trains the model on the batches and rank 0 writes the full parameters
to OUT/<case>.safetensors (decay_cases: model, batches, settings)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ms_llm.machine import Machine
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name

from decay_cases import MODEL, batches, job

SHARED, NATIVE = {"engine": "shared"}, {"engine": "native"}
# world-2 cases: the shared engine's sharded buckets (a segment holds pieces of 1-D and 2-D parameters),
# torch's ZeroRedundancyOptimizer and FSDP2 with param groups, DTensor parameters under tp.
CASES = {
    "shared_zero2": {"dp": 2, "zero": {"stage": 2, **SHARED}},
    "shared_zero3": {"dp": 2, "zero": {"stage": 3, **SHARED}},
    "native_zero1": {"dp": 2, "zero": {"stage": 1, **NATIVE}},
    "native_zero3": {"dp": 2, "zero": {"stage": 3, **NATIVE}},
    "tp2": {"tp": 2},
}


def trained(strategy: dict, model: dict = MODEL) -> dict[str, torch.Tensor]:
    """Train decay_cases' steps under `strategy` on this process group; full parameters by name."""
    world, rank = dist.get_world_size(), dist.get_rank()
    j = job(strategy, model)
    plan = make_plan(j.model, j.strategy, j.train, world)
    low = lower(plan, Machine("cpu"))
    meshes = build_meshes(low.mesh, "cpu", low.expert_mesh)
    step_fn = TrainStep(apply(low, plan, meshes, torch.device("cpu"), rank))
    dp_rank, dp = meshes.coord("dp"), meshes.size("dp")
    for k, rows in enumerate(torch.from_numpy(batches(j.model.vocab_size))):
        step_fn(k, rows.chunk(dp)[dp_rank])
    step_fn.m.dp.gather_params()
    return {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for part in step_fn.m.parts for n, p in part.named_parameters()}


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in cases:
        params = trained(CASES[case])
        if dist.get_rank() == 0:
            save_file(params, out / f"{case}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
