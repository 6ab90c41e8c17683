"""Small collective cells of the CPU data-parallel runtime (MindSpore's CPU collectives are
AllReduce, AllGather and Broadcast; ZeRO's are the shared engine's, ms_llm.mindspore.zero)."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops


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
