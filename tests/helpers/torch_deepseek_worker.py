"""DeepSeek-style matrix worker, run under torchrun by tests/torch/test_torch_deepseek_matrix.py.

    torchrun --nproc-per-node W tests/helpers/torch_deepseek_worker.py TOKENS OUT case [case ...]

Like tests/helpers/torch_moe_worker.py, on configs/models/tiny_deepseek.yaml: multi-latent attention
with the query's low-rank path, a dense first layer, sigmoid group-limited routing (dropless) with
the aux-loss-free expert bias and the sequence-wise balance loss, a shared expert, one MTP module.
Each case writes its losses and MTP losses, its parameters after the last step (experts gathered
from their ep and tp slices), and every rank its expert biases.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import save_file

from ms_llm.data import GlobalBatchSampler
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name
from torch_matrix_worker import FP32, FencedSteps, main
from torch_moe_worker import full_params

ROOT = Path(__file__).resolve().parents[2]
MODEL = yaml.safe_load((ROOT / "configs" / "models" / "tiny_deepseek.yaml").read_text())
# A bias rate that moves the routing within the 5 steps, and a balance loss that weighs.
MODEL["moe"] |= {"bias_update_rate": 0.02, "seq_aux_loss_coeff": 1e-2}
NO_MTP = MODEL | {"mtp_layers": 0}          # pipeline parallel: the torch backend refuses MTP there
STEPS = 5

# name -> (world size, model, strategy); SGD throughout, so parameters compare at 1e-5.
CASES: dict[str, tuple[int, dict, dict]] = {
    "ref": (1, MODEL, {}),
    "ref_no_mtp": (1, NO_MTP, {}),
    "dp2": (2, MODEL, {"dp": 2}),
    "tp2": (2, MODEL, {"tp": 2}),
    "ep2": (2, MODEL, {"dp": 2, "ep": 2}),
    "pp2_no_mtp": (2, NO_MTP, {"pp": 2, "pipeline": {"schedule": "1f1b"}}),
    "ep2_dp2_zero1": (4, MODEL, {"dp": 4, "ep": 2, "zero": {"stage": 1}}),
    "ep2_tp2": (4, MODEL, {"dp": 2, "ep": 2, "tp": 2}),
}


def job_for(case: str):
    _, model, strategy = CASES[case]
    return job_from_dict({
        "name": case, "device": "cpu", "model": model, "strategy": {**strategy, "precision": FP32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                  "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.01, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 1}},
    })


def expert_biases(parts) -> dict[str, torch.Tensor]:
    return {f"bias/{canonical_name(n)}": b.detach().clone() for part in parts
            for n, b in part.named_buffers() if n.endswith("e_score_correction_bias")}


def run_case(case: str, tokens, out: Path) -> None:
    rank = dist.get_rank()
    job = job_for(case)
    tc = job.train
    plan = make_plan(job.model, job.strategy, tc, dist.get_world_size())
    low = lower(plan, Machine("cpu"))
    meshes = build_meshes(plan.mesh, "cpu", low.expert_mesh)
    lowered = apply(low, plan, meshes, torch.device("cpu"), rank)
    step_fn = TrainStep(lowered)
    sampler = GlobalBatchSampler(tokens, tc.seq_len, tc.global_batch_size, tc.seed)
    dp_rank, dp_size = meshes.coord("dp"), meshes.size("dp")
    steps = FencedSteps(step_fn, plan, rank)
    losses, mtp_losses = [], []
    for k in range(tc.steps):
        losses.append(steps(k, torch.from_numpy(sampler.local_batch(k, dp_rank, dp_size))))
        if step_fn.mtp_loss is not None:
            mtp_losses.append(step_fn.mtp_loss.item())
    lowered.dp.gather_params()
    tensors = full_params(lowered.parts, plan, meshes)
    if dp_rank == 0 and meshes.coord("tp") == 0:
        save_file(tensors, out / f"{case}-rank{rank}.safetensors")
    save_file(expert_biases(lowered.parts), out / f"{case}-bias{rank}.safetensors")
    if rank == 0:
        (out / f"{case}.json").write_text(json.dumps({"losses": losses, "mtp_losses": mtp_losses}))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:], run_case)
