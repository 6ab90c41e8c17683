"""Checkpoints in the torch trainer: what this rank holds, saving on a cadence, resuming.

Every tensor of the training state is paired with the Piece of its global tensor this rank
holds, whatever engine runs data parallelism:
  - model weights: DTensors (tensor parallel, FSDP2) describe their own piece; plain tensors
    hold the plan's layout;
  - torch optimizers (AdamW / SGD, ZeroRedundancyOptimizer's local one): per-parameter
    states sit where their parameter sits (ZeroRedundancyOptimizer: whole, on the owner);
  - the shared ZeRO engine: its flat segments are cut into the pieces ms_llm.zero's
    ZeroPlan says each rank owns (Adam moments, fp32 master, ZeRO-3 weight shards).
Names are the checkpoint's (Hugging Face weights, optim.<state>.<weight>), so a run resumes
under any strategy, engine or world size, and from MindSpore checkpoints.
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ms_llm.checkpoint import (Checkpoint, CheckpointWriter, IntervalInputs, MemoryTier, Piece, Region,
                               candidates, choose_interval, layout_piece, load_with_fallback, optim_name,
                               restore_folders, run_config)
from ms_llm.checkpoint.format import INDEX
from ms_llm.config.job import JobConfig
from ms_llm.data.sampler import SamplerState
from ms_llm.errors import CheckpointError
from ms_llm.run import MetricsLogger, RunFolder, lr_at
from ms_llm.strategy.plan import ModelPlan
from torch_backend.checkpoint import load_into, save_items
from torch_backend.step import TrainStep
from torch_backend.weights import canonical_name

Held = dict[str, tuple[Piece, torch.Tensor]]


def _dtensor_piece(name: str, t: DTensor, plan: ModelPlan, rank: int) -> Piece:
    if any(p.is_partial() for p in t.placements):
        raise CheckpointError(f"{name}: a partial-sum DTensor cannot be saved; reduce it first")
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    split = {a for n, p in zip(t.device_mesh.mesh_dim_names, t.placements) if p.is_shard()
             for a in plan.mesh.expand(n)}
    coords = plan.mesh.coords(rank)
    primary = all(coords[a] == 0 for a in plan.stage_mesh.names if a not in split)
    return Piece(name, tuple(t.shape), Region(offsets, sizes), primary)


def _piece(name: str, t: torch.Tensor, plan: ModelPlan, rank: int, weight: str) -> Piece:
    if isinstance(t, DTensor):
        return _dtensor_piece(name, t, plan, rank)
    return layout_piece(name, plan.params[weight].layout, plan.stage_rank(rank))


def _zero_engine(step_fn: TrainStep):
    dp = step_fn.m.dp
    return dp.engine.engine if dp.name == "shared" else None


def _shared_engine_state(engine, plan: ModelPlan, rank: int) -> Held:
    """Adam moments, master weights and ZeRO-3 weight shards of the shared engine."""
    zplan, held = engine.zplan, {}
    index = zplan.shard_index(rank)
    for b in engine.buckets:
        st = engine.state[b.index]
        base = b.start + (index * b.segment if b.sharded else 0)
        tensors = {"exp_avg": st.m, "exp_avg_sq": st.v, "master": st.master}
        for owned in zplan.pieces(rank, b):
            shape = plan.params[owned.name].shape
            region = Region(*owned.global_box)
            cut = slice(owned.start - base, owned.start - base + owned.numel)
            for state, flat in tensors.items():
                if flat is not None:
                    name = optim_name(state, owned.name)
                    held[name] = (Piece(name, shape, region, owned.primary), flat[cut].view(region.sizes))
            if st.param_shard is not None:
                held[owned.name] = (Piece(owned.name, shape, region, owned.primary),
                                    st.param_shard[cut].view(region.sizes))
    return held


def _optimizer_state(step_fn: TrainStep, weights: dict[str, torch.Tensor], plan: ModelPlan, rank: int,
                     create: bool) -> Held:
    """Per-parameter states of a torch optimizer; `create` makes Adam's before its first step."""
    optimizer, held = step_fn.optimizer, {}
    owner = isinstance(optimizer, ZeroRedundancyOptimizer)
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
    else:
        held.update(_optimizer_state(step_fn, weights, plan, rank, create))
    for name, p in weights.items():
        if name not in held:                # ZeRO-3 shards of the shared engine are already in
            held[name] = (_piece(name, p, plan, rank, name), p)
    return held


def _master_of(name: str) -> Optional[str]:
    """The weight an optim.master.<weight> tensor copies, None for other names."""
    prefix = optim_name("master", "")
    return name[len(prefix):] if name.startswith(prefix) else None


def set_optimizer_step(step_fn: TrainStep, steps: int) -> None:
    engine = _zero_engine(step_fn)
    if engine is not None:
        engine.step_count = steps
        return
    optimizer = step_fn.optimizer
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    for state in local.state.values():
        if "step" in state:
            state["step"].fill_(steps)


def _session(rank: int) -> str:
    """A token equal on all ranks of this launch and new for every launch."""
    token = torch.tensor([int.from_bytes(os.urandom(7), "little") if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(token, 0)
    return f"{int(token):x}"


class TrainerCheckpoints:
    """The trainer's side: `start = resume()`, `after_step(k, dt)` each step, `close()`."""

    def __init__(self, job: JobConfig, run: RunFolder, plan: ModelPlan, step_fn: TrainStep, sampler, rank: int,
                 logger: MetricsLogger):
        self.job, self.run, self.plan, self.step_fn, self.sampler, self.rank = job, run, plan, step_fn, sampler, rank
        self.logger = logger
        self.cfg = job.train.checkpoint
        self.memory = None
        if self.cfg.memory_tier:
            job_id = f"{job.name}-{zlib.crc32(str(run.root).encode()):08x}"
            local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
            self.memory = MemoryTier.for_job(job_id, local_world_size=local)
        self.writer: Optional[CheckpointWriter] = None
        self.interval = self.cfg.interval if isinstance(self.cfg.interval, int) else None
        self.step_times: list[float] = []

    # ---- resume --------------------------------------------------------------------------
    def _folders(self) -> list:
        if self.cfg.load:
            path = self.run.root.parent / self.cfg.load if not os.path.isabs(self.cfg.load) else self.cfg.load
            return [path] if (os.path.isfile(os.path.join(path, INDEX))) else candidates(path)
        return restore_folders(self.run.checkpoints, self.memory)

    def resume(self) -> int:
        """Load the newest usable checkpoint (the memory tier when it is newest); return the
        step to continue from (0 when there is none)."""
        folders = self._folders()
        if not folders:
            if self.cfg.load:
                raise CheckpointError(f"train.checkpoint.load: {self.cfg.load} holds no committed checkpoint")
            return 0
        held = training_state(self.step_fn, self.plan, self.rank, create=True)
        pieces = {n: p for n, (p, _) in held.items()}
        tensors = {n: t for n, (_, t) in held.items()}
        weights = [n for n in pieces if n in self.plan.params]

        def load(ckpt: Checkpoint) -> list[str]:
            missing = [n for n in weights if n not in ckpt.index.tensors]
            if missing:
                raise CheckpointError(f"{ckpt.folder}: lacks weight {missing[0]!r}; a different model?")
            loaded = load_into(ckpt, pieces, tensors, strict=False)
            # A run keeping fp32 master weights, resumed from one that did not: start them from the weights.
            masters = {w: n for n in pieces if n not in ckpt.index.tensors and (w := _master_of(n))}
            return loaded + load_into(ckpt, {w: dataclasses.replace(pieces[n], name=w) for w, n in masters.items()},
                                      {w: tensors[n] for w, n in masters.items()})

        ckpt, _ = load_with_fallback(folders, load)
        steps = torch.tensor([ckpt.step, -ckpt.step], dtype=torch.int64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) != -int(steps[1]):
            raise CheckpointError(f"ranks restored different steps ({-int(steps[1])} .. {int(steps[0])}); a "
                                  "checkpoint is damaged on some ranks only: remove it and restart")
        state = ckpt.state
        if "sampler" in state and self.sampler.step_of(SamplerState.from_dict(state["sampler"])) != ckpt.step:
            raise CheckpointError(f"{ckpt.folder}: data position does not match step {ckpt.step}; train.seed or "
                                  "global_batch_size changed since it was saved")
        set_optimizer_step(self.step_fn, int(state.get("optimizer_step", ckpt.step)))
        own = ckpt.rank_state(self.rank)
        if own and "torch_rng" in own and ckpt.index.world_size == self.plan.world_size:
            torch.set_rng_state(torch.from_numpy(np.frombuffer(own["torch_rng"], dtype=np.uint8).copy()))
        if self.rank == 0:
            print(f"resumed from {ckpt.folder} (step {ckpt.step}, saved by {ckpt.config.get('backend', '?')} on "
                  f"{ckpt.index.world_size} rank(s))", flush=True)
        return ckpt.step

    # ---- save ----------------------------------------------------------------------------
    def after_step(self, step: int, step_time: float) -> None:
        """Called with the number of completed steps; saves on the cadence."""
        self.step_times.append(step_time)
        if self.cfg.interval == 0:
            return
        if self.interval is None:           # 'auto': save once to measure, then decide
            if self.writer is None:
                self.save(step)
            elif self.writer.last is not None and self.writer.last.step < step:
                self._decide()
            return
        if step % self.interval == 0 or step == self.plan.train.steps:
            self.save(step)

    def _decide(self) -> None:
        last = self.writer.wait()
        measured = torch.tensor([last.stall_s, last.total_s, float(np.median(self.step_times))], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)     # every rank takes the same decision
        stall, total, iter_s = measured.tolist()
        decision = choose_interval(IntervalInputs(stall, total, iter_s, total, self.cfg.mtbf_hours))
        self.interval = decision.steps
        if self.rank == 0:
            print(decision.report(), flush=True)

    def save(self, step: int) -> None:
        if self.writer is None:
            self.writer = CheckpointWriter(self.run.checkpoints, self.rank, self.plan.world_size,
                                           session=_session(self.rank), keep_last=self.cfg.keep_last,
                                           memory=self.memory)
        held = training_state(self.step_fn, self.plan, self.rank)
        pieces = {n: p for n, (p, _) in held.items()}
        items = save_items(pieces, {n: t for n, (_, t) in held.items()})
        state = {"step": step, "optimizer_step": step, "lr": lr_at(step, self.plan.train),
                 "sampler": self.sampler.state_at(step).to_dict(), "loss_scale": None}
        rank_state = {"torch_rng": torch.get_rng_state().numpy().tobytes()}
        previous = self.writer.last
        stats = self.writer.save(step, items, state=state, rank_state=rank_state,
                                 config=run_config(self.plan, "torch"))     # waits for `previous` first
        self._report_durable(previous)
        self.logger.event(checkpoint_step=step, stall_s=stats.stall_s, wait_s=stats.wait_s, bytes=stats.bytes)
        if not self.cfg.async_save:
            self.writer.wait()

    def _report_durable(self, stats) -> None:
        """A metrics record for a save once it is durable."""
        if stats is not None:
            self.logger.event(checkpoint_step=stats.step, total_s=stats.total_s, persist_s=stats.persist_s)

    def close(self) -> None:
        if self.writer is not None:
            self._report_durable(self.writer.wait())
            self.writer.close()
