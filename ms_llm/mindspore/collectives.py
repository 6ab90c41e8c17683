"""Process groups and small collective cells of the CPU data-parallel runtime.

MindSpore's CPU collectives are AllReduce, AllGather and Broadcast (ReduceScatter and
send/recv are not registered on CPU), so ZeRO's reduce-scatter is AllReduce-then-slice
(optim.py) and its parameter gather is AllGather over the shard group from the plan."""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import nn, ops
from mindspore.communication import GlobalComm, create_group

from ms_llm.mindspore.optim import ZeroShard
from ms_llm.strategy.plan import ModelPlan


class MeanOverRanks(nn.Cell):
    """Average a scalar over every rank (the logged loss of a data-parallel step)."""

    def __init__(self, world: int):
        super().__init__()
        self.all_reduce = ops.AllReduce()
        self.world = float(world)

    def construct(self, x):
        return self.all_reduce(x) / self.world


class BroadcastParams(nn.Cell):
    """Copy rank 0's parameters to every rank (as DDP does at start): all ranks step from one model
    even if something other than the shared seed set the weights."""

    def __init__(self, params):
        super().__init__(auto_prefix=False)
        self.params = ms.ParameterTuple(params)
        self.broadcast = ops.Broadcast(0)
        self.assign = ops.Assign()

    def construct(self):
        values = self.broadcast(tuple(p * 1.0 for p in self.params))
        for i in range(len(self.params)):
            self.assign(self.params[i], values[i])
        return values[0]


def _group_name(ranks: list[int], world: int, created: dict) -> str:
    if ranks == list(range(world)):
        return GlobalComm.WORLD_COMM_GROUP
    name = "zero_" + "_".join(map(str, ranks))
    if name not in created:
        create_group(name, ranks)
        created[name] = ranks
    return name


def zero_shards(plan: ModelPlan, names: list[str], rank: int) -> list[Optional[ZeroShard]]:
    """This rank's ZeRO shard of each named parameter (None: its optimizer state is replicated).
    The shard is the plan's optimizer layout; its gather group is the plan's ZeRO axes."""
    if plan.zero.stage == 0 or plan.zero.group_size == 1:
        return [None] * len(names)
    axis = "dp_shard_cp" if len(plan.zero.axes) > 1 else plan.zero.axes[0]
    group = plan.mesh.group_of(axis, rank)
    created: dict = {}
    local = plan.stage_rank(rank)
    shards = []
    for name in names:
        p = plan.params[name]
        if p.optimizer_layout == p.layout:
            shards.append(None)
            continue
        (dim,) = {pl.dim for a, pl in zip(p.layout.mesh.names, p.optimizer_layout.placements) if a in plan.zero.axes}
        offsets, sizes = p.optimizer_layout.shard_box(local)
        index = offsets[dim] // sizes[dim]
        if index != group.index(rank):
            raise RuntimeError(f"{name}: ZeRO shard {index} on rank {rank} is not its place {group.index(rank)} "
                               f"in the gather group {group}")
        shards.append(ZeroShard(dim, index, plan.zero.group_size, _group_name(group, ms.communication.get_group_size(),
                                                                             created)))
    return shards
