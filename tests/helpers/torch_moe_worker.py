"""Expert-parallel matrix worker, run under torchrun by tests/torch/test_torch_moe_matrix.py.

    torchrun --nproc-per-node W tests/helpers/torch_moe_worker.py TOKENS OUT case [case ...]

Like tests/helpers/torch_matrix_worker.py, on tiny_moe (dropless router, so the result does not depend
on how tokens are split; z-loss on, the load-balancing loss off, since it is not additive over
ranks): each case writes its losses and its parameters after the last step (and where gradients stay
on the parameters, those of the first step), experts gathered from their ep and etp slices to full
tensors, and the bytes of the routed experts' weights, gradients and optimizer states rank 0's ZeRO
engine (shared, or FSDP2) holds at the end of the last backward, beside the ZeRO plan's and the cost
model's figures for them.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import save_file

from ms_llm.checkpoint import CheckpointWriter, run_config
from ms_llm.data import GlobalBatchSampler
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy.cost import memory
from ms_llm.strategy.plan import plan as make_plan
from ms_llm.strategy.shape import cost_shape
from torch_backend.apply import apply
from torch_backend.checkpoint import local, save_items
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.state import training_state
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name
from torch_matrix_worker import FP32, FencedSteps, full, main

ROOT = Path(__file__).resolve().parents[2]
MODEL = yaml.safe_load((ROOT / "configs" / "models" / "tiny_moe.yaml").read_text())
MODEL["moe"] |= {"aux_loss_coeff": 0.0, "z_loss_coeff": 1e-3}
STEPS = 3

# name -> (world size, strategy); SGD throughout, so parameters compare at 1e-5.
CASES: dict[str, tuple[int, dict]] = {
    "ref": (1, {}),
    "ep2": (2, {"dp": 2, "ep": 2}),
    "ep2_cp2": (2, {"dp": 1, "cp": 2, "ep": 2, "context_parallel": {"algorithm": "ring"}}),   # experts over dp*cp
    # FSDP2 with edp 1, the experts' unit one rank: ep = dp, and ep over cp (experts divided by dp x cp)
    "ep2_zero2_fsdp2": (2, {"dp": 2, "ep": 2, "zero": {"stage": 2, "engine": "native"}}),
    "ep2_cp2_zero2_fsdp2": (2, {"dp": 1, "cp": 2, "ep": 2, "context_parallel": {"algorithm": "ring"},
                                "zero": {"stage": 2, "engine": "native"}}),
    "ep2_dp2_zero1": (4, {"dp": 4, "ep": 2, "zero": {"stage": 1}}),
    "ep2_dp2_zero3": (4, {"dp": 4, "ep": 2, "zero": {"stage": 3}}),
    "ep2_tp2": (4, {"dp": 2, "ep": 2, "tp": 2}),
    "ep2_pp2": (4, {"dp": 2, "ep": 2, "pp": 2, "pipeline": {"schedule": "1f1b"}}),
    # expert parallel folding: etp carved out of dp; ep folded over dp x tp with whole experts
    "ep2_etp2_zero1": (4, {"dp": 4, "ep": 2, "etp": 2, "zero": {"stage": 1}}),
    "ep2_etp2_zero3": (4, {"dp": 4, "ep": 2, "etp": 2, "zero": {"stage": 3}}),
    "ep4_dp2_tp2_zero1": (4, {"dp": 2, "tp": 2, "ep": 4, "etp": 1, "zero": {"stage": 1}}),
    "ep4_dp2_tp2_zero3": (4, {"dp": 2, "tp": 2, "ep": 4, "etp": 1, "zero": {"stage": 3}}),
    # edp 2 over dp: ZeRO-2 shards the experts' gradients over it, ZeRO-3 their weights too
    "ep2_dp2_tp2_etp1_zero2": (4, {"dp": 2, "tp": 2, "ep": 2, "etp": 1, "zero": {"stage": 2}}),
    "ep2_dp2_tp2_etp1_zero3": (4, {"dp": 2, "tp": 2, "ep": 2, "etp": 1, "zero": {"stage": 3}}),
    # torch's FSDP2: the experts a shard group of their own over edp 2, the dense weights over dp 4
    "ep2_dp2_zero2_fsdp2": (4, {"dp": 4, "ep": 2, "zero": {"stage": 2, "engine": "native"}}),
    "ep2_dp2_zero3_fsdp2": (4, {"dp": 4, "ep": 2, "zero": {"stage": 3, "engine": "native"}}),
    # FSDP2 beside model parallelism (edp 1): the experts split over tp (etp 2, norm summed over it), and pp
    "ep2_tp2_etp2_zero2_fsdp2": (4, {"dp": 2, "tp": 2, "ep": 2, "etp": 2, "zero": {"stage": 2, "engine": "native"}}),
    "ep2_pp2_zero2_fsdp2": (4, {"dp": 2, "ep": 2, "pp": 2, "pipeline": {"schedule": "1f1b"},
                                "zero": {"stage": 2, "engine": "native"}}),
}

SAVED = ("ep2_dp2_zero3_fsdp2",)      # cases that also save a checkpoint after the last step


def job_for(case: str):
    _, strategy = CASES[case]
    return job_from_dict({
        "name": case, "device": "cpu", "model": MODEL, "strategy": {**strategy, "precision": FP32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                  "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.01, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 1}},
    })


def full_params(parts, plan, meshes, what: str = "param") -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters (or gradients); experts all-gathered over ep (dim 0) and
    etp (their width)."""
    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            name = canonical_name(name)
            t = full(p if what == "param" else p.grad)
            if plan.params[name].kind.startswith("expert"):
                for axis in ("ep", "etp"):
                    dim = plan.params[name].layout.placements[plan.params[name].layout.mesh.names.index(axis)]
                    if getattr(plan.strategy, axis) > 1:
                        pieces = [torch.empty_like(t) for _ in range(getattr(plan.strategy, axis))]
                        dist.all_gather(pieces, t, group=meshes.expert_group(axis))
                        t = torch.cat(pieces, dim=dim.dim)
            out[f"{what}/{name}"] = t
    return out


class MeasuredSteps(FencedSteps):
    """FencedSteps that also records, at the fence (the end of backward, gradients reduced), the bytes
    the shared engine holds in the routed experts' buckets, or FSDP2 in their weight and gradient shards."""

    def __init__(self, step_fn: TrainStep, plan, rank: int):
        super().__init__(step_fn, plan, rank)
        self.dp = step_fn.m.dp
        self.engine = self.dp.engine.engine if self.dp.name == "shared" else None
        self.expert_bytes: dict | None = None

    def before_update(self) -> None:
        super().before_update()
        if self.engine is not None:
            self.expert_bytes = self.engine.model_state_bytes(experts=True)
        elif self.dp.name == "fsdp2":
            experts = [p for part in self.step_fn.m.parts for p in part.parameters() if id(p) in self.dp.expert_params]
            self.expert_bytes = {"params": sum(local(p).nbytes for p in experts),
                                 "grads": sum(local(p.grad).nbytes for p in experts), "optimizer": 0}


def save_checkpoint(step_fn: TrainStep, plan, rank: int, root: Path) -> None:
    """The training state as the trainer saves it, every rank its pieces (FSDP2: its edp shard of its experts)."""
    held = training_state(step_fn, plan, rank)
    writer = CheckpointWriter(root, rank, dist.get_world_size(), session="moe_matrix")
    items = save_items({n: piece for n, (piece, _) in held.items()}, {n: t for n, (_, t) in held.items()})
    writer.save(STEPS, items, state={"step": STEPS}, config=run_config(plan, "torch"))
    writer.close()


def run_case(case: str, tokens, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    job = job_for(case)
    tc = job.train
    plan = make_plan(job.model, job.strategy, tc, world)
    low = lower(plan, Machine("cpu"))
    meshes = build_meshes(plan.mesh, "cpu", low.expert_mesh)
    lowered = apply(low, plan, meshes, torch.device("cpu"), rank)
    step_fn = TrainStep(lowered)
    sampler = GlobalBatchSampler(tokens, tc.seq_len, tc.global_batch_size, tc.seed)
    dp_rank, dp_size = meshes.coord("dp"), meshes.size("dp")
    tensors = {}
    if step_fn.optimizer is not None:     # the shared engine keeps gradients in its buckets
        first = torch.from_numpy(sampler.local_batch(0, dp_rank, dp_size))
        step_fn.forward_backward(first[:, :-1], first[:, 1:])
        lowered.dp.reduce_grads(lowered.parts)
        tensors = full_params(lowered.parts, plan, meshes, "grad")
        step_fn.optimizer.zero_grad(set_to_none=True)
    steps = MeasuredSteps(step_fn, plan, rank)
    losses = [steps(k, torch.from_numpy(sampler.local_batch(k, dp_rank, dp_size))) for k in range(tc.steps)]
    if case in SAVED:
        save_checkpoint(step_fn, plan, rank, out / case)
    lowered.dp.gather_params()
    tensors |= full_params(lowered.parts, plan, meshes)
    if dp_rank == 0 and meshes.coord("tp") == 0:
        save_file(tensors, out / f"{case}-rank{rank}.safetensors")
    if rank == 0:
        record = {"losses": losses, "edp": plan.strategy.edp, "expert_bytes": steps.expert_bytes,
                  "local_expert_bytes": 4 * sum(math.prod(q.layout.local_shape()) for q in plan.params_of_stage(0)
                                                if q.kind.startswith("expert")),
                  "cost_expert_bytes": memory(cost_shape(plan)).experts}
        if steps.engine is not None:
            record["planned_expert_bytes"] = steps.engine.zplan.model_state_bytes(rank, "sgd", experts=True)
        (out / f"{case}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:], run_case)
