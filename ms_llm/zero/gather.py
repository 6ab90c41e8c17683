"""ZeRO-3 parameter lifetime: gather a unit just before use, free it after, prefetch the next.

Forward: before unit i runs, its all-gather is waited for (or issued) and unit i+1's is
issued, so the next layer's parameters travel while this one computes; after unit i runs
its parameters are freed, except the last unit's, which backward needs at once.
Backward walks the units in reverse: before unit i's backward it is gathered again and
unit i-1 prefetched; once every gradient of unit i has arrived it is freed.
A unit of only replicated parameters (none sharded) is never freed.
"""
from __future__ import annotations

from typing import Any, Protocol

from ms_llm.zero.partition import Bucket, Unit
from ms_llm.zero.plan import ZeroPlan
from ms_llm.zero.protocol import Handle, Tensor, TensorOps


class GatherHost(Protocol):
    """What UnitGather uses of its engine (ms_llm.zero.engine.ZeroEngine, which owns it)."""
    zplan: ZeroPlan
    rank: int
    ops: TensorOps
    state: dict[int, Any]           # per bucket: its param_shard
    params: dict[str, Tensor]
    in_backward: bool

    def gather_bucket(self, b: Bucket, pbuf: Tensor) -> Handle: ...

    def own_index(self, b: Bucket) -> int:
        """This rank's segment of `b`."""


class UnitGather:
    def __init__(self, engine: GatherHost):
        self.engine = engine
        self.units = [u for u in engine.zplan.units_of(engine.rank)
                      if any(engine.zplan.buckets[b].sharded for b in u.buckets)]
        self.position = {u.name: i for i, u in enumerate(self.units)}
        self.status = {u.name: "free" for u in self.units}
        self.inflight: dict[str, list[tuple[int, Tensor, Handle]]] = {}
        self.waiting = {u.name: set(u.params) for u in self.units}
        self.gathers = 0                # units gathered so far
        self.peak_live = 0              # most units whole (or in flight) at once

    def manages(self, unit: str) -> bool:
        return unit in self.position

    def _issue(self, u: Unit) -> None:
        if self.status[u.name] != "free":
            return
        e, ops = self.engine, self.engine.ops
        issued = []
        for index in u.buckets:
            b = e.zplan.buckets[index]
            if not b.sharded:
                continue
            pbuf = ops.empty(b.numel, e.zplan.buffers[b.buffer].dtype)     # filled whole: shard + gather
            pbuf = ops.write(pbuf, e.own_index(b) * b.segment, e.state[index].param_shard)
            issued.append((index, pbuf, e.gather_bucket(b, pbuf)))
        self.inflight[u.name] = issued
        self.status[u.name] = "gathering"
        self.gathers += 1
        self.peak_live = max(self.peak_live, sum(s != "free" for s in self.status.values()))

    def _wait(self, u: Unit) -> None:
        e, ops = self.engine, self.engine.ops
        for index, pbuf, handle in self.inflight.pop(u.name):
            handle.wait()
            b = e.zplan.buckets[index]
            for s in b.slots:
                param = e.params[s.name]
                ops.materialize(param)
                ops.unpack(pbuf, 0, b.segment, s, param)
            ops.free(pbuf)
        self.status[u.name] = "ready"

    def _ensure(self, i: int, prefetch: int) -> None:
        u = self.units[i]
        self._issue(u)
        if self.status[u.name] == "gathering":
            self._wait(u)
        j = i + prefetch
        if 0 <= j < len(self.units):
            self._issue(self.units[j])

    def _free(self, u: Unit) -> None:
        if self.status[u.name] == "gathering":
            self._wait(u)
        if self.status[u.name] == "ready":
            e = self.engine
            for index in u.buckets:
                b = e.zplan.buckets[index]
                if b.sharded:
                    for s in b.slots:
                        e.ops.release(e.params[s.name])
            self.status[u.name] = "free"

    def before_forward(self, unit: str) -> None:
        self._ensure(self.position[unit], +1)

    def after_forward(self, unit: str) -> None:
        """Free after forward, unless backward is running (recomputation) or the unit is
        the last one, whose backward comes next."""
        i = self.position[unit]
        if not self.engine.in_backward and i != len(self.units) - 1:
            self._free(self.units[i])

    def before_backward(self, unit: str) -> None:
        self.engine.in_backward = True
        self._ensure(self.position[unit], -1)

    def after_backward(self, unit: str) -> None:
        """Free a unit whose backward has run (backends with module backward hooks)."""
        self._free(self.units[self.position[unit]])

    def on_grad(self, unit: str, name: str) -> None:
        """Free a unit once its last gradient has arrived: its backward is done."""
        if unit not in self.waiting:
            return
        pending = self.waiting[unit]
        pending.discard(name)
        if not pending:
            self._free(self.units[self.position[unit]])

    def gather_all(self) -> None:
        """Make every parameter whole (evaluation, export); free_all undoes it."""
        for u in self.units:
            self._issue(u)
        for u in self.units:
            if self.status[u.name] == "gathering":
                self._wait(u)

    def free_all(self) -> None:
        for u in self.units:
            self._free(u)

    def finish_backward(self) -> None:
        """Free what is still gathered (units whose parameters got no gradient, prefetches)
        and reset the per-backward bookkeeping."""
        self.free_all()
        for u in self.units:
            self.waiting[u.name] = set(u.params)
