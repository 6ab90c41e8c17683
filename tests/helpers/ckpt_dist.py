"""Multi-process checkpoint harness (gloo): ranks save their slices, another world loads.

One spawn of up to 4 processes runs a list of jobs (starting 4 torch processes is the slow
part on a small machine). For each job:
save: ranks < source world slice the reference state by the plan (its layouts, or a ZeRO
flat buffer for the optimizer states) and save through torch_backend.checkpoint.
load: ranks < target world load their pieces of the target plan into torch tensors; the
primary pieces are summed into one full-size canvas per tensor with all_reduce (each
element has exactly one primary holder, and x + 0 == x bit for bit) and rank 0 compares
the canvases with the reference.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_helpers import STATES, cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, Piece, Region, flat_pieces, layout_piece, optim_name
from ms_llm.checkpoint import param_pieces, run_config
from ms_llm.nodes import free_port
from ms_llm.strategy.layout import Shard
from torch_backend.checkpoint import load_into, save_items

MAX_WORLD = 4


def flat_optimizer_pieces(plan, rank: int) -> dict[str, Piece]:
    """Optimizer states held as a ZeRO flat buffer: the stage's tensor-parallel pieces in plan
    order, padded to the shard group, each group member owning one contiguous run."""
    srank = plan.stage_rank(rank)
    coords = plan.stage_mesh.coords(srank)
    group, index = 1, 0
    for axis in plan.zero.axes:
        size = plan.stage_mesh.axis_size(axis)
        group, index = group * size, index * size + coords[axis]
    stage = plan.mesh.coords(rank)["pp"]
    out = {}
    for state in STATES:
        members, offset = [], 0
        for p in plan.params_of_stage(stage):
            name = optim_name(state, p.name)
            tp_piece = layout_piece(name, p.layout, srank)
            primary = all(coords[a] == 0 for a, q in zip(plan.stage_mesh.names, p.layout.placements)
                          if not isinstance(q, Shard) and a not in plan.zero.axes)
            members.append((Piece(name, p.shape, tp_piece.region, primary, tp_piece.layout), offset))
            offset += tp_piece.region.numel
        per = -(-offset // group)
        for piece in flat_pieces(members, index * per, (index + 1) * per):
            out[piece.name] = piece
    return out


def pieces_of(side: dict, rank: int) -> dict[str, Piece]:
    plan = plan_for(side["strategy"], side["world"])
    if side.get("flat"):
        return param_pieces(plan, rank) | flat_optimizer_pieces(plan, rank)
    return rank_pieces(plan, rank)


def place(canvas: np.ndarray, region: Region, data: np.ndarray) -> None:
    """Write a piece's data where it sits in the full-size canvas."""
    box = canvas[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))]
    if region.flat:
        run_ = box.reshape(-1).copy()
        run_[region.flat[0]:region.flat[1]] = data
        box[...] = run_.reshape(region.sizes)
    else:
        box[...] = data


def _save(rank: int, job: dict, ref: dict) -> None:
    side = job["save"]
    pieces = pieces_of(side, rank)
    tensors = {n: torch.from_numpy(cut(ref[n], p.region)) for n, p in pieces.items()}
    writer = CheckpointWriter(job["root"], rank, side["world"], session=job["root"])
    writer.save(job["step"], save_items(pieces, tensors), state={"step": job["step"]}, rank_state={"rank": rank},
                config=run_config(plan_for(side["strategy"], side["world"]), "torch"))
    writer.close()


def _load(rank: int, job: dict, ref: dict, group) -> dict:
    pieces = pieces_of(job["load"], rank)
    ckpt = Checkpoint.open(job["root"])
    local = {n: torch.zeros(p.local_shape) for n, p in pieces.items()}
    load_into(ckpt, pieces, local)
    names = sorted(ref)
    canvases = [np.zeros(ref[n].shape, dtype=np.float32) for n in names]
    counts = [np.zeros(ref[n].shape, dtype=np.float32) for n in names]
    for name, canvas, count in zip(names, canvases, counts):
        p = pieces.get(name)
        if p is not None and p.primary:
            place(canvas, p.region, local[name].numpy())
            place(count, p.region, np.ones(p.local_shape, dtype=np.float32))
    flat = torch.from_numpy(np.concatenate([c.reshape(-1) for c in canvases + counts]))
    dist.all_reduce(flat, group=group)
    values, hits = np.split(flat.numpy(), 2)
    bad, offset = [], 0
    for name in names:
        n = ref[name].size
        if not ((hits[offset:offset + n] == 1).all()
                and np.array_equal(values[offset:offset + n].view(np.uint32), ref[name].reshape(-1).view(np.uint32))):
            bad.append(name)
        offset += n
    return {"bad": bad, "step": ckpt.step, "state": ckpt.state, "rank_state": ckpt.rank_state(1)}


def _worker(rank: int, port: int, jobs: list[dict], result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=MAX_WORLD)
    groups = {w: dist.new_group(list(range(w))) for w in range(1, MAX_WORLD + 1)}
    ref = reference()
    results = []
    try:
        for job in jobs:
            if rank < job["save"]["world"]:
                _save(rank, job, ref)
            dist.barrier()
            if rank < job["load"]["world"]:
                out = _load(rank, job, ref, groups[job["load"]["world"]])
                results.append(out)
            dist.barrier()
        if rank == 0:
            Path(result).write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_jobs(jobs: list[dict], result: Path) -> list[dict]:
    """jobs: {"root", "step", "save": {"strategy", "world", "flat"?}, "load": {...}}; rank 0's
    result per job."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(free_port(), jobs, str(result)), nprocs=MAX_WORLD, join=True)
    return json.loads(Path(result).read_text())
