"""DeepSeek-style matrix worker, run under torchrun by tests/torch/test_torch_deepseek_matrix.py.

    torchrun --nproc-per-node W tests/helpers/torch_deepseek_worker.py TOKENS OUT case [case ...]

Like tests/helpers/torch_moe_worker.py, on configs/models/tiny_deepseek.yaml: multi-latent attention
with the query's low-rank path, a dense first layer, sigmoid group-limited routing (dropless) with
the aux-loss-free expert bias and the sequence-wise balance loss, a shared expert, one MTP module
(and its dense variant, for the engines a model with experts does not take).
Each case writes its losses and MTP losses, its parameters after the last step (experts gathered
from their ep and tp slices; under pipeline parallel the MTP stage's copy of the embedding as
copy/<name>), and every rank its expert biases. Cases named *_resume save a checkpoint after
RESUME_AT steps, train on, then load it into a fresh trainer and train the same steps again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import save_file

from ms_llm.checkpoint import Checkpoint, CheckpointWriter, run_config
from ms_llm.data import GlobalBatchSampler
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.state import TorchTrainerState
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name
from torch_matrix_worker import FP32, FencedSteps, main
from torch_moe_worker import full_params

ROOT = Path(__file__).resolve().parents[2]
MODEL = yaml.safe_load((ROOT / "configs" / "models" / "tiny_deepseek.yaml").read_text())
# A bias rate that moves the routing within the 5 steps, and a balance loss that weighs.
MODEL["moe"] |= {"bias_update_rate": 0.02, "seq_aux_loss_coeff": 1e-2}
NO_MTP = MODEL | {"mtp_layers": 0}
DENSE = MODEL | {"moe": None}              # MLA and MTP on a dense model: the engines MoE does not take
STEPS = 5
RESUME_AT = 3
PP = {"pp": 2, "pipeline": {"schedule": "1f1b"}}

# name -> (world size, model, strategy); SGD (AdamW when resumed), so parameters compare at 1e-5.
CASES: dict[str, tuple[int, dict, dict]] = {
    "ref": (1, MODEL, {}),
    "ref_dense": (1, DENSE, {}),
    "dp2": (2, MODEL, {"dp": 2}),
    "tp2": (2, MODEL, {"tp": 2}),
    "ep2": (2, MODEL, {"dp": 2, "ep": 2}),
    "pp2": (2, MODEL, PP),                                            # MTP and the embedding copy on stage 1
    "pp2_resume": (2, MODEL, PP),
    "ep2_dp2_zero1": (4, MODEL, {"dp": 4, "ep": 2, "zero": {"stage": 1}}),
    "ep2_tp2": (4, MODEL, {"dp": 2, "ep": 2, "tp": 2}),
    "pp2_ep2_zero1": (4, MODEL, {**PP, "dp": 2, "ep": 2, "zero": {"stage": 1}}),     # the shipped DeepSeek-V3 job's
    "pp2_ep2_zero1_resume": (4, MODEL, {**PP, "dp": 2, "ep": 2, "zero": {"stage": 1}}),
    "dense_pp2_dp2_zero3": (4, DENSE, {**PP, "dp": 2, "zero": {"stage": 3}}),                  # the copy gathered
    "dense_pp2_dp2_fsdp": (4, DENSE, {**PP, "dp": 2, "zero": {"stage": 2, "engine": "native"}}),   # FSDP2 shards
}


def job_for(case: str):
    _, model, strategy = CASES[case]
    # A resumed run compares with itself: AdamW, so the optimizer states must come back too.
    optimizer = ({"name": "adamw", "lr": 1e-2} if case.endswith("_resume") else {"name": "sgd", "lr": 0.5})
    return job_from_dict({
        "name": case, "device": "cpu", "model": model, "strategy": {**strategy, "precision": FP32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 16, "steps": STEPS, "seed": 7,
                  "optimizer": {**optimizer, "weight_decay": 0.01, "grad_clip": 1.0},
                  "schedule": {"warmup_steps": 1}},
    })


def expert_biases(parts) -> dict[str, torch.Tensor]:
    return {f"bias/{canonical_name(n)}": b.detach().clone() for part in parts
            for n, b in part.named_buffers() if n.endswith("e_score_correction_bias")}


def build(case: str):
    """(plan, meshes, lowered, step function) of this rank."""
    job = job_for(case)
    plan = make_plan(job.model, job.strategy, job.train, dist.get_world_size())
    low = lower(plan, Machine("cpu"))
    meshes = build_meshes(plan.mesh, "cpu", low.expert_mesh)
    lowered = apply(low, plan, meshes, torch.device("cpu"), dist.get_rank())
    return plan, meshes, lowered, TrainStep(lowered)


def train(plan, meshes, step_fn, tokens, steps: range) -> tuple[list[float], list[float]]:
    """Losses and MTP losses of `steps`, each on its global batch."""
    tc = plan.train
    sampler = GlobalBatchSampler(tokens, tc.seq_len, tc.global_batch_size, tc.seed)
    dp_rank, dp_size = meshes.coord("dp"), meshes.size("dp")
    fenced = FencedSteps(step_fn, plan, dist.get_rank())
    fenced.fences = steps.start                  # it counts the fences of steps 0.. (a resumed run's too)
    losses, mtp_losses = [], []
    for k in steps:
        losses.append(fenced(k, torch.from_numpy(sampler.local_batch(k, dp_rank, dp_size))))
        if step_fn.mtp_loss is not None:
            mtp_losses.append(step_fn.mtp_loss.item())
    return losses, mtp_losses


def parameters(plan, meshes, lowered, prefix: str = "param") -> dict[str, torch.Tensor]:
    """Full parameters of this rank; a copy of another stage's weight (the MTP stage's embedding)
    as copy/<name>."""
    lowered.dp.gather_params()
    stage = meshes.coord("pp")
    return {(f"copy/{k[len('param/'):]}" if plan.params[k[len("param/"):]].stage != stage else
             f"{prefix}/{k[len('param/'):]}"): t for k, t in full_params(lowered.parts, plan, meshes).items()}


def save_checkpoint(step_fn, plan, root: Path, step: int) -> None:
    rank = dist.get_rank()
    state = TorchTrainerState(step_fn, plan, rank)
    held = state.held(create=False)
    writer = CheckpointWriter(root, rank, dist.get_world_size())
    writer.save(step, state.save_items({n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()}),
                state={"step": step}, config=run_config(plan, "torch"))
    writer.close()
    dist.barrier()                 # rank 0 has committed


def load_checkpoint(step_fn, plan, root: Path, step: int) -> None:
    state = TorchTrainerState(step_fn, plan, dist.get_rank())
    held = state.held(create=True)
    with Checkpoint.open(root) as ckpt:
        state.load_into(ckpt, {n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()})
    state.set_optimizer_step(step)


def run_case(case: str, tokens, out: Path) -> None:
    rank = dist.get_rank()
    plan, meshes, lowered, step_fn = build(case)
    if not case.endswith("_resume"):
        losses, mtp_losses = train(plan, meshes, step_fn, tokens, range(STEPS))
        record = {"losses": losses, "mtp_losses": mtp_losses}
        tensors = parameters(plan, meshes, lowered)
    else:
        root = out / f"{case}-ckpt"
        train(plan, meshes, step_fn, tokens, range(RESUME_AT))
        save_checkpoint(step_fn, plan, root, RESUME_AT)
        losses, mtp_losses = train(plan, meshes, step_fn, tokens, range(RESUME_AT, STEPS))
        tensors = parameters(plan, meshes, lowered)
        plan, meshes, lowered, step_fn = build(case)                  # a fresh trainer
        load_checkpoint(step_fn, plan, root, RESUME_AT)
        again, mtp_again = train(plan, meshes, step_fn, tokens, range(RESUME_AT, STEPS))
        record = {"losses": losses, "mtp_losses": mtp_losses, "resumed_losses": again, "resumed_mtp_losses": mtp_again}
        tensors |= {k: t for k, t in parameters(plan, meshes, lowered, "resumed").items() if not k.startswith("copy/")}
    if meshes.coord("dp") == 0 and meshes.coord("tp") == 0:
        save_file(tensors, out / f"{case}-rank{rank}.safetensors")
    save_file(expert_biases(lowered.parts), out / f"{case}-bias{rank}.safetensors")
    if rank == 0:
        (out / f"{case}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:], run_case)
