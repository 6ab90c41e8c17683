"""Correctness-matrix worker, run under torchrun by tests/torch/test_torch_matrix.py.

    torchrun --nproc-per-node W tests/helpers/torch_matrix_worker.py TOKENS OUT case [case ...]

Every case trains the same tiny fp32 model on the same global batches under one strategy
and writes: the loss of each step, the gradients of the first step (before any update) and
the parameters after the last step, gathered to full tensors (the shared ZeRO engine holds
gradients in its own buckets: its cases compare losses and parameters). Case "ref" (world 1) also
runs a hand-written single-process loop that shares none of the lowering.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.run import lr_at
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply, cross_entropy
from torch_backend.checkpoint import local
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.model import Transformer
from torch_backend.state import training_state
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name

MODEL = dict(name="matrix", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, max_seq_len=32, dtype="float32")
# Cases named qwen_*: the same model with Qwen's extra parameters (q/k/v biases, q/k norms per head)
# and a head_dim apart from hidden / heads.
QWEN = dict(MODEL, name="matrix_qwen", qkv_bias=True, qk_norm=True, head_dim=16)
# Cases named deep_* and the virtual-stage schedules (pp x virtual_stages = 4 chunks, a layer each).
DEEP = dict(MODEL, name="matrix_deep", num_layers=4)
STEPS = 3                  # the losses of steps 2 and 3 follow an update each; parameters after the third
FP32 = {"param_dtype": "float32", "compute_dtype": "float32"}
NATIVE, SHARED = {"engine": "native"}, {"engine": "shared"}

# name -> (world size, strategy, optimizer). "native": DDP / FSDP2 / ZeroRedundancyOptimizer;
# "shared": ms_llm's ZeRO engine.
CASES: dict[str, tuple[int, dict, str]] = {
    "ref": (1, {}, "sgd"),
    "ref_adamw": (1, {}, "adamw"),
    "qwen_ref": (1, {}, "sgd"),
    "deep_ref": (1, {}, "sgd"),
    "compile_selective": (1, {"recompute": {"policy": "selective"}}, "sgd"),     # train.compile: true
    "dp2": (2, {"dp": 2, "zero": NATIVE}, "sgd"),
    "dp2_adamw": (2, {"dp": 2, "zero": NATIVE}, "adamw"),
    "tp2": (2, {"tp": 2}, "sgd"),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}, "sgd"),
    "qwen_tp2_sp": (2, {"tp": 2, "sequence_parallel": True}, "sgd"),
    "tp2_sp_adamw": (2, {"tp": 2, "sequence_parallel": True}, "adamw"),
    "tp2_sp_selective": (2, {"tp": 2, "sequence_parallel": True, "recompute": {"policy": "selective"}}, "sgd"),
    "pp2_gpipe": (2, {"pp": 2, "pipeline": {"schedule": "gpipe"}}, "sgd"),
    "pp2_1f1b": (2, {"pp": 2, "pipeline": {"schedule": "1f1b"}}, "sgd"),
    "pp2_interleaved": (2, {"pp": 2, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, "sgd"),
    "pp2_zero_bubble": (2, {"pp": 2, "pipeline": {"schedule": "zero_bubble"}}, "sgd"),
    "pp2_zbv": (2, {"pp": 2, "pipeline": {"schedule": "zbv", "virtual_stages": 2}}, "sgd"),
    "zero1_dp2": (2, {"dp": 2, "zero": {"stage": 1, **NATIVE}}, "sgd"),
    "zero2_dp2": (2, {"dp": 2, "zero": {"stage": 2, **NATIVE}}, "sgd"),
    "zero3_dp2": (2, {"dp": 2, "zero": {"stage": 3, **NATIVE}, "recompute": {"policy": "full"}}, "sgd"),
    "zero3_dp2_adamw": (2, {"dp": 2, "zero": {"stage": 3, **NATIVE}}, "adamw"),
    "shared_dp2": (2, {"dp": 2, "zero": SHARED}, "sgd"),
    "shared_zero1_dp2": (2, {"dp": 2, "zero": {"stage": 1, **SHARED}}, "sgd"),
    "shared_zero2_dp2": (2, {"dp": 2, "zero": {"stage": 2, **SHARED}}, "sgd"),
    "shared_zero3_dp2": (2, {"dp": 2, "zero": {"stage": 3, **SHARED}}, "sgd"),
    "shared_zero3_dp2_ac": (2, {"dp": 2, "zero": {"stage": 3, **SHARED}, "recompute": {"policy": "full"}}, "sgd"),
    "shared_zero1_dp2_adamw": (2, {"dp": 2, "zero": {"stage": 1, **SHARED}}, "adamw"),
    "shared_zero2_dp2_offload": (2, {"dp": 2, "zero": {"stage": 2}, "offload": {"optimizer": True}}, "sgd"),
    "cp2_ring": (2, {"cp": 2, "context_parallel": {"algorithm": "ring"}, "zero": NATIVE}, "sgd"),
    "cp2_ulysses": (2, {"cp": 2, "context_parallel": {"algorithm": "ulysses"}}, "sgd"),       # shared engine
    "cp2_allgather": (2, {"cp": 2, "context_parallel": {"algorithm": "allgather"}, "zero": NATIVE}, "sgd"),
    "dp4": (4, {"dp": 4, "zero": NATIVE}, "sgd"),
    "cp4_ring": (4, {"cp": 4, "context_parallel": {"algorithm": "ring"}, "recompute": {"policy": "full"},
                     "zero": NATIVE}, "sgd"),
    "cp4_ulysses": (4, {"cp": 4, "context_parallel": {"algorithm": "ulysses"}, "zero": NATIVE}, "sgd"),  # kv repeated
    "cp2_tp2_sp_ring": (4, {"cp": 2, "tp": 2, "sequence_parallel": True, "context_parallel": {"algorithm": "ring"},
                            "zero": NATIVE}, "sgd"),
    "cp2_tp2_ulysses": (4, {"cp": 2, "tp": 2, "context_parallel": {"algorithm": "ulysses"}}, "adamw"),
    "cp2_dp2_zero3": (4, {"cp": 2, "dp": 2, "zero": {"stage": 3, **NATIVE}}, "sgd"),
    "cp2_pp2": (4, {"cp": 2, "pp": 2, "pipeline": {"schedule": "1f1b"}, "zero": NATIVE}, "sgd"),
    "zero1_dp4": (4, {"dp": 4, "zero": {"stage": 1, **NATIVE}}, "sgd"),
    "zero2_dp4": (4, {"dp": 4, "zero": {"stage": 2, **NATIVE}}, "sgd"),
    "zero3_dp4": (4, {"dp": 4, "zero": {"stage": 3, **NATIVE}}, "sgd"),
    "zero3_hsdp": (4, {"dp": 4, "zero": {"stage": 3, "shard_size": 2, **NATIVE}}, "sgd"),
    "shared_zero0_pp2_dp2": (4, {"pp": 2, "dp": 2, "pipeline": {"schedule": "1f1b"}, "zero": SHARED}, "sgd"),
    "shared_pp2_dp2": (4, {"pp": 2, "dp": 2, "pipeline": {"schedule": "1f1b"}, "zero": {"stage": 1, **SHARED}},
                       "sgd"),
    "shared_zero3_pp2_dp2": (4, {"pp": 2, "dp": 2, "pipeline": {"schedule": "gpipe"},
                                 "zero": {"stage": 3, **SHARED}}, "sgd"),
    "shared_zero3_dp4": (4, {"dp": 4, "zero": {"stage": 3, **SHARED}}, "sgd"),
    "shared_zero2_hsdp": (4, {"dp": 4, "zero": {"stage": 2, "shard_size": 2, **SHARED}}, "sgd"),
    "shared_zero1_dp2_tp2_sp": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": {"stage": 1, **SHARED}},
                                "sgd"),
    "shared_zero2_dp2_tp2": (4, {"dp": 2, "tp": 2, "zero": {"stage": 2, **SHARED}}, "adamw"),
    "shared_zero3_dp2_tp2_sp": (4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": {"stage": 3, **SHARED}},
                                "sgd"),
    "shared_zero2_pp2_dp2_interleaved": (4, {"pp": 2, "dp": 2, "zero": {"stage": 2, **SHARED},
                                             "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, "sgd"),
    "shared_zero3_pp2_dp2_interleaved": (4, {"pp": 2, "dp": 2, "zero": {"stage": 3, **SHARED},
                                             "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, "sgd"),
}


def model_for(case: str) -> dict:
    strategy = CASES[case][1]
    if case.startswith("qwen"):
        return QWEN
    if case.startswith("deep") or strategy.get("pipeline", {}).get("virtual_stages", 1) > 1:
        return DEEP
    return MODEL


def job_for(case: str):
    world, strategy, opt = CASES[case]
    lr = 0.5 if opt == "sgd" else 1e-2
    compile = case.startswith("compile")
    return job_from_dict({
        "name": case, "device": "cpu", "model": model_for(case),
        "strategy": {**strategy, "precision": FP32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                  "compile": compile,
                  "optimizer": {"name": opt, "lr": lr, "weight_decay": 0.01, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 1}},
    })


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().contiguous()


def gathered(parts, what: str) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters (or their gradients); collective over each mesh."""
    out = {}
    for part in parts:
        for name, p in part.named_parameters():
            t = p if what == "param" else p.grad
            out[f"{what}/{canonical_name(name)}"] = full(t)
    return out


def plain_reference(job, sampler) -> list[float]:
    """The textbook loop: whole global batch at once, no lowering, no wrappers."""
    tc = job.train
    model = Transformer(job.model)
    model.init_weights(tc.seed)
    o = tc.optimizer
    opt = (torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay) if o.name == "sgd" else
           torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay))
    losses = []
    for step in range(tc.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        batch = torch.from_numpy(sampler.local_batch(step))
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optimizer.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class FencedSteps:
    """Runs the steps as the shared loop does, checking its contract (ms_llm/run/loop.py,
    StepFunction): no tensor of the training state changes before the step calls
    before_update, where the loop fences an overlapped checkpoint snapshot that may still be
    copying them. Each check compares every tensor with its value after the previous step."""

    def __init__(self, step_fn: TrainStep, plan, rank: int):
        self.step_fn, self.plan, self.rank = step_fn, plan, rank
        self.fences, self.after_step = 0, self.values()

    def values(self) -> dict[str, torch.Tensor]:
        held = training_state(self.step_fn, self.plan, self.rank, False)
        return {name: local(t).detach().clone() for name, (_, t) in held.items()}

    def before_update(self) -> None:
        now = self.values()
        changed = [name for name, value in self.after_step.items() if not torch.equal(now[name], value)]
        assert not changed, f"rank {self.rank}: written before the checkpoint fence: {changed[:3]}"
        self.fences += 1

    def __call__(self, k: int, batch: torch.Tensor) -> float:
        loss = self.step_fn(k, batch, self.before_update)[0].item()
        assert self.fences == k + 1, f"rank {self.rank}: step {k} did not call before_update once"
        self.after_step = self.values()
        return loss


def run_case(case: str, tokens: np.ndarray, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    job = job_for(case)
    tc = job.train
    plan = make_plan(job.model, job.strategy, tc, world)
    meshes = build_meshes(plan.mesh, "cpu")
    lowered = apply(lower(plan, Machine("cpu")), plan, meshes, torch.device("cpu"), rank)
    step_fn = TrainStep(lowered)
    sampler = GlobalBatchSampler(tokens, tc.seq_len, tc.global_batch_size, tc.seed)
    dp_rank, dp_size = meshes.coord("dp"), meshes.size("dp")

    tensors = {}
    if step_fn.optimizer is not None:     # the shared engine keeps gradients in its buckets
        first = torch.from_numpy(sampler.local_batch(0, dp_rank, dp_size))
        step_fn.forward_backward(first[:, :-1], first[:, 1:])
        lowered.dp.reduce_grads(lowered.parts)
        tensors = gathered(lowered.parts, "grad")
        step_fn.optimizer.zero_grad(set_to_none=True)

    steps = FencedSteps(step_fn, plan, rank)
    losses = [steps(k, torch.from_numpy(sampler.local_batch(k, dp_rank, dp_size))) for k in range(tc.steps)]
    lowered.dp.gather_params()
    tensors |= gathered(lowered.parts, "param")
    if meshes.coord("dp") == 0 and meshes.coord("tp") == 0:
        save_file(tensors, out / f"{case}-rank{rank}.safetensors")
    if rank == 0:
        record = {"losses": losses}
        if world == 1:
            record["plain_losses"] = plain_reference(job, sampler)
        (out / f"{case}.json").write_text(json.dumps(record))
    dist.barrier()


def main(argv: list[str], run=None) -> None:
    """TOKENS OUT case...: each case through `run` (default run_case; the MoE worker passes its own)."""
    tokens_path, out, cases = argv[0], Path(argv[1]), argv[2:]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    tokens = load_tokens(Path(tokens_path))
    for case in cases:
        (run or run_case)(case, tokens, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)      # as torchrun sets for W > 1: a world-1 run's idle OpenMP threads only spin
    main(sys.argv[1:])
