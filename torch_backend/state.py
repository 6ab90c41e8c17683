"""The torch trainer's training state for ms_llm.run.checkpoints (save cadence, resume).

Every tensor of the training state is paired with the Piece of its global tensor this rank
holds, whatever engine runs data parallelism:
  - model weights: DTensors (tensor parallel, FSDP2) describe their own piece; plain tensors
    hold the plan's layout;
  - torch optimizers (AdamW / SGD, ZeroRedundancyOptimizer's local one): per-parameter
    states sit where their parameter sits (ZeroRedundancyOptimizer: whole, on the owner);
  - the shared ZeRO engine: its flat segments are cut into the pieces ms_llm.zero's
    ZeroPlan says each rank owns (Adam moments, fp32 master, ZeRO-3 weight shards).
The embedding's copy on the MTP modules' pipeline stage (and its optimizer states) is held,
not saved: the first stage saves the embedding once, and a load fills both copies.
Names are the checkpoint's (Hugging Face weights, optim.<state>.<weight>), so a run resumes
under any strategy, engine or world size, and from MindSpore checkpoints.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import torch.distributed as dist

from ms_llm.checkpoint import Piece, Region, layout_piece, optim_name, split_optim_name
from ms_llm.checkpoint.zero_state import engine_slices
from ms_llm.errors import CheckpointError
from ms_llm.run.checkpoints import Held
from ms_llm.strategy.layout import Shard
from ms_llm.strategy.plan import ModelPlan
from torch_backend.checkpoint import load_into, save_items
from torch_backend.dist import is_dtensor, is_loaded_instance
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name


def _dtensor_piece(name: str, t: torch.Tensor, plan: ModelPlan, rank: int) -> Piece:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if any(p.is_partial() for p in t.placements):
        raise CheckpointError(f"{name}: a partial-sum DTensor cannot be saved; reduce it first")
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    split = {a for n, p in zip(t.device_mesh.mesh_dim_names, t.placements) if p.is_shard()
             for a in plan.mesh.expand(n)}
    coords = plan.mesh.coords(rank)
    primary = all(coords[a] == 0 for a in plan.stage_mesh.names if a not in split)
    return Piece(name, tuple(t.shape), Region(offsets, sizes), primary)


def _expert_dtensor_piece(name: str, t: torch.Tensor, plan: ModelPlan, rank: int, weight: str) -> Piece:
    """An FSDP2 shard of a routed expert (torch_backend.parallelize.dp.FSDP): its DTensor spans this
    rank's ep / etp slice only, split over edp, so its box is within the plan layout's piece, and each
    edp rank holds its own."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    layout = plan.params[weight].layout
    piece = layout_piece(name, layout, plan.stage_rank(rank))
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = layout.mesh.coords(plan.stage_rank(rank))
    primary = all(coords[a] == 0 for a, q in zip(layout.mesh.names, layout.placements) if a != "edp" and not isinstance(q, Shard))
    region = Region(tuple(a + b for a, b in zip(piece.region.offsets, offsets)), tuple(sizes))
    return dataclasses.replace(piece, region=region, primary=primary)


def _piece(name: str, t: torch.Tensor, plan: ModelPlan, rank: int, weight: str) -> Piece:
    if is_dtensor(t) and plan.params[weight].kind.startswith("expert"):
        return _expert_dtensor_piece(name, t, plan, rank, weight)
    if is_dtensor(t):
        return _dtensor_piece(name, t, plan, rank)
    return layout_piece(name, plan.params[weight].layout, plan.stage_rank(rank))


def _zero_engine(step_fn: TrainStep):
    dp = step_fn.m.dp
    return dp.engine.engine if dp.name == "shared" else None


def _shared_engine_state(engine, plan: ModelPlan, rank: int) -> Held:
    """Adam moments, master weights and ZeRO-3 weight shards of the shared engine: views."""
    held = {}
    for name, s in engine_slices(engine, plan, rank).items():
        flat = getattr(engine.state[s.bucket], s.attr)
        held[name] = (s.piece, flat[s.start:s.start + s.numel].view(s.piece.region.sizes))
    return held


def _torch_optimizer(step_fn: TrainStep):
    """The torch optimizer whose per-parameter states this rank holds: the step's own (None under
    the shared engine, which holds every state, the routed experts' included)."""
    return step_fn.optimizer if _zero_engine(step_fn) is None else None


def _optimizer_state(optimizer, weights: dict[str, torch.Tensor], plan: ModelPlan, rank: int,
                     create: bool) -> Held:
    """Per-parameter states of a torch optimizer; `create` makes Adam's before its first step.
    Expert states take their weight's layout (split over ep), so they reshard like it."""
    held = {}
    owner = is_loaded_instance(optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer")
    local = optimizer.optim if owner else optimizer
    mine = {id(p) for g in local.param_groups for p in g["params"]}
    adam = isinstance(local, torch.optim.AdamW)
    for weight, p in weights.items():
        if id(p) not in mine:
            continue
        state = local.state[p]
        if create and adam and not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        for key, value in state.items():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            name = optim_name(key, weight)
            piece = _piece(name, value, plan, rank, weight)
            if owner:                       # only the owning rank has it, whole
                piece = Piece(name, piece.shape, Region((0,) * len(piece.shape), piece.shape), True)
            held[name] = (piece, value)
    return held


def training_state(step_fn: TrainStep, plan: ModelPlan, rank: int, create: bool = False) -> Held:
    """Every tensor of this rank's training state, by checkpoint name, with its piece."""
    weights = {canonical_name(n): p for part in step_fn.m.parts for n, p in part.named_parameters()}
    engine = _zero_engine(step_fn)
    held: Held = {}
    if engine is not None:
        held.update(_shared_engine_state(engine, plan, rank))
    optimizer = _torch_optimizer(step_fn)
    if optimizer is not None:
        held.update(_optimizer_state(optimizer, weights, plan, rank, create))
    for name, p in weights.items():
        if name not in held:                # ZeRO-3 shards of the shared engine are already in
            held[name] = (_piece(name, p, plan, rank, name), p)
    held.update(_buffers(step_fn, plan, rank))
    return _copies_held(held, weights, plan, rank)


def _copies_held(held: Held, weights: dict[str, torch.Tensor], plan: ModelPlan, rank: int) -> Held:
    """The weights of another pipeline stage this rank keeps a copy of (the MTP modules'
    embedding), with their optimizer states: not primary, so their own stage saves them."""
    stage = plan.mesh.coords(rank)["pp"]
    copies = {n for n in weights if plan.params[n].stage != stage}
    if not copies:
        return held
    out = {}
    for name, (piece, t) in held.items():
        weight = (split_optim_name(name) or (None, name))[1]
        if weight in copies:
            piece = dataclasses.replace(piece, primary=False)
        out[name] = (piece, t)
    return out


def _buffers(step_fn: TrainStep, plan: ModelPlan, rank: int) -> Held:
    """The persistent buffers (the routers' expert bias): whole and equal on every rank of their
    stage, saved by its first rank."""
    held = {}
    for part in step_fn.m.parts:
        params = {id(p) for p in part.parameters()}
        for n, t in part.state_dict(keep_vars=True).items():
            if id(t) not in params:
                region = Region((0,) * t.dim(), tuple(t.shape))
                held[canonical_name(n)] = (Piece(canonical_name(n), tuple(t.shape), region,
                                                 plan.stage_rank(rank) == 0), t)
    return held


class TorchTrainerState:
    """ms_llm.run.checkpoints.TrainerState over a TrainStep (any engine, any lowering)."""
    backend = "torch"

    def __init__(self, step_fn: TrainStep, plan: ModelPlan, rank: int):
        self.step_fn, self.plan, self.rank = step_fn, plan, rank

    def held(self, create: bool) -> Held:
        return training_state(self.step_fn, self.plan, self.rank, create)

    save_items = staticmethod(save_items)
    load_into = staticmethod(load_into)

    def max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def session_token(self) -> str:
        token = torch.tensor([int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(token, 0)
        return f"{int(token):x}"

    def set_optimizer_step(self, steps: int) -> None:
        engine = _zero_engine(self.step_fn)
        if engine is not None:
            engine.step_count = steps
        optimizer = _torch_optimizer(self.step_fn)
        if optimizer is not None:
            owner = is_loaded_instance(optimizer, "torch.distributed.optim", "ZeroRedundancyOptimizer")
            local = optimizer.optim if owner else optimizer
            for state in local.state.values():
                if "step" in state:
                    state["step"].fill_(steps)

    def rank_state(self) -> dict:
        return {"torch_rng": torch.get_rng_state().numpy().tobytes()}

    def set_rank_state(self, state: dict) -> None:
        if "torch_rng" in state:
            torch.set_rng_state(torch.from_numpy(np.frombuffer(state["torch_rng"], dtype=np.uint8).copy()))
