"""The ZeRO engine: stages 0-3 written once over the device protocol.

A backend feeds it gradients as they become final (`on_grad`, from torch's
post-accumulate-grad hooks or after MindSpore's grad function), tells it when backward
ends (`finish_backward`) and calls `step(lr)`. Under ZeRO-3 it also calls the unit hooks
of ms_llm.zero.gather around each layer's forward and backward.

Per bucket and step (see ms_llm.zero.schedule):
  backward  gradients are packed rank-major into the bucket; a full bucket is reduced
            (reduce-scatter over the shard group, all-reduce over replicas), buckets in a
            fixed order so every rank issues the same collectives in the same order;
  step      a tied copy's gradient (the MTP stage's embedding, Megatron-core's embedding
            group) summed with its original's; global gradient norm from each element's
            primary copy; the optimizer updates this rank's segment (fp32 master when
            parameters are low precision or states are offloaded); ZeRO-1/2 all-gather the
            updated parameters, ZeRO-3 keeps the shard.
Unsharded buckets (every bucket at stage 0) stay allocated where the backend can alias
them: the model's parameters and gradients are views of them (like DDP's
gradient_as_bucket_view), so neither packing nor unpacking copies anything.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from ms_llm.config.train import TrainConfig, decays
from ms_llm.strategy.ir import ParallelStrategy
from ms_llm.zero.gather import UnitGather
from ms_llm.zero.partition import Bucket
from ms_llm.zero.plan import ZeroPlan
from ms_llm.zero.protocol import SGD, AdamW, Comm, Handle, Tensor, TensorOps


@dataclass(frozen=True)
class EngineConfig:
    optimizer: Union[AdamW, SGD]
    grad_clip: float               # global-norm clip, 0 = off
    master_dtype: Optional[str]    # keep an fp32 (master) copy of the owned parameters
    reduce_dtype: str              # dtype gradients travel in
    offload: bool = False          # optimizer states and master in host memory
    decay_1d: bool = True          # weight decay on 1-D parameters too (train.optimizer.weight_decay_1d)

    @classmethod
    def from_job(cls, strategy: ParallelStrategy, train: TrainConfig) -> "EngineConfig":
        opt, prec = train.optimizer, strategy.precision
        offload = strategy.offload.optimizer
        optimizer: Union[AdamW, SGD] = (AdamW(opt.beta1, opt.beta2, opt.eps, opt.weight_decay)
                                        if opt.name == "adamw" else SGD(opt.weight_decay))
        master = prec.master_dtype if (prec.master_dtype != prec.param_dtype or offload) else None
        return cls(optimizer, opt.grad_clip, master, prec.grad_reduce_dtype, offload, opt.weight_decay_1d)


@dataclass
class _BucketState:
    grad_full: Optional[Tensor] = None      # the whole bucket's gradient (rank-major)
    grad_shard: Optional[Tensor] = None     # ZeRO-2/3: the reduced, accumulated own segment
    param_shard: Optional[Tensor] = None    # ZeRO-3: the owned segment of the parameters
    param_full: Optional[Tensor] = None     # unsharded bucket the model's parameters are views of
    grads_bound: bool = False               # the model's gradients are views of grad_full
    master: Optional[Tensor] = None
    m: Optional[Tensor] = None
    v: Optional[Tensor] = None
    ready: set = field(default_factory=set)
    norm_ranges: tuple[tuple[int, int], ...] = ()
    decay: tuple[tuple[int, int], ...] = ()  # ranges of the owned segment weight decay applies to


class ZeroEngine:
    def __init__(self, zplan: ZeroPlan, rank: int, params: dict[str, Tensor], comm: Comm, ops: TensorOps,
                 config: EngineConfig, world_size: int):
        self.zplan, self.rank, self.params, self.comm, self.ops, self.config = zplan, rank, params, comm, ops, config
        self.buckets = zplan.buckets_of(rank)
        self._index = {b.index: zplan.segment_index(rank, b) for b in self.buckets}
        self.groups = self._make_groups(world_size)
        self.sync = True
        self.step_count = 0
        self.in_backward = False
        self._next_launch = 0
        self._inflight: list[tuple[Bucket, Tensor, Handle]] = []
        self._reduce_order = list(reversed(self.buckets))
        self._slot = {s.name: (b, s) for b in self.buckets for s in b.slots}
        stage = zplan.pipeline_stage(rank)
        self._unit = {e.name: e.unit for e in zplan.entries if e.stage == stage}
        self._tied = zplan.tied_names()
        missing = sorted(set(self._slot) - set(params))
        if missing:
            raise KeyError(f"ZeRO engine: the model has no parameter {missing[0]!r} the plan expects")
        self.state = {b.index: _BucketState() for b in self.buckets}
        self._broadcast_params()
        for b in self.buckets:
            self._init_bucket(b)
        self.gather = UnitGather(self) if zplan.stage >= 3 else None

    # ---- setup -------------------------------------------------------------------------
    def _make_groups(self, world_size: int) -> dict[str, Any]:
        """Every rank creates every group in the same order (torch.distributed requires it)."""
        mine = {}
        for kind in ("shard", "replicate", "dp", "embedding", "expert_shard", "expert_dp"):
            for ranks in self.zplan.groups.get(kind, ()):
                handle = self.comm.new_group(ranks) if len(ranks) > 1 else None
                if self.rank in ranks:
                    mine[kind] = handle
        mine["world"] = self.comm.new_group(list(range(world_size))) if world_size > 1 else None
        return mine

    def _broadcast_params(self) -> None:
        """Replicas start equal (as DDP guarantees), whatever each process initialised: over dp,
        the routed experts over edp."""
        for b in self.buckets:
            kind = self.zplan.group_kind(b, "dp")
            if self.groups[kind] is None:
                continue
            src = self.zplan.group_of(kind, self.rank)[0]
            for s in b.slots:
                self.comm.broadcast(self.params[s.name], src, self.groups[kind])

    def _group(self, b: Bucket, kind: str) -> Any:
        """The communication group of `kind` (shard, replicate, dp) for bucket `b`: the dense one, or
        the experts' (over edp)."""
        return self.groups[self.zplan.group_kind(b, kind)]

    def own_index(self, b: Bucket) -> int:
        """The segment of `b` this rank owns: its place in the bucket's shard group (0 if replicated)."""
        return self._index[b.index]

    def _dtype(self, b: Bucket) -> str:
        return self.zplan.buffers[b.buffer].dtype

    def _own_start(self, b: Bucket) -> int:
        return self.own_index(b) * b.segment

    def _own_params(self, b: Bucket) -> Tensor:
        """A bucket whose owned segment holds the current parameter values, packed from the
        model (the other segments are for the all-gather to fill)."""
        if self.state[b.index].param_full is not None:
            return self.state[b.index].param_full
        buf = self.ops.zeros(b.numel, self._dtype(b)) if b.padding else self.ops.empty(b.numel, self._dtype(b))
        for s in b.slots:
            if b.sharded:
                buf = self.ops.pack_own(buf, 0, b.segment, s, self.own_index(b), self.params[s.name])
            else:
                buf = self.ops.pack(buf, 0, b.segment, s, self.params[s.name], accumulate=False)
        return buf

    def _init_bucket(self, b: Bucket) -> None:
        st, cfg = self.state[b.index], self.config
        if not b.sharded:
            self._bind(b)
        own = self.ops.read(self._own_params(b), self._own_start(b), b.segment)
        state_dtype = cfg.master_dtype or self._dtype(b)
        if cfg.master_dtype:
            st.master = self.ops.cast(own, cfg.master_dtype, host=cfg.offload)
        if isinstance(cfg.optimizer, AdamW):
            st.m = self.ops.zeros(b.segment, state_dtype, host=cfg.offload)
            st.v = self.ops.zeros(b.segment, state_dtype, host=cfg.offload)
        if self.zplan.stage >= 3 and b.sharded:
            st.param_shard = self.ops.cast(own, self._dtype(b))
            for s in b.slots:
                self.ops.release(self.params[s.name])
        start = self._own_start(b) + b.start
        st.norm_ranges = _merge([(p.start - start, p.start - start + p.numel)
                                 for p in self.zplan.pieces(self.rank, b) if p.primary])
        st.decay = self._decay_ranges(b)

    def _decay_ranges(self, b: Bucket) -> tuple[tuple[int, int], ...]:
        """The whole owned segment (its padding stays 0), or, where some parameters are exempt
        (1-D ones with weight_decay_1d false), the pieces of the others: every segment holds
        each parameter's piece at the same offset."""
        kept = [s for s in b.slots if decays(s.local_shape, self.config.decay_1d)]
        if len(kept) == len(b.slots):
            return ((0, b.segment),)
        return _merge([(s.offset, s.offset + s.numel) for s in kept])

    def _bind(self, b: Bucket) -> None:
        """Make the model's parameters and gradients views of the bucket, where the backend can."""
        st, params = self.state[b.index], [self.params[s.name] for s in b.slots]
        full = self._own_params(b)
        if not self.ops.bind(full, b.slots, params, grads=False):
            self.ops.free(full)
            return
        st.param_full = full
        grads = self.ops.zeros(b.numel, self._dtype(b))
        st.grads_bound = self.ops.bind(grads, b.slots, params, grads=True)
        if st.grads_bound:
            st.grad_full = grads
        else:
            self.ops.free(grads)

    # ---- backward ----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches before the last); ZeRO-2/3 still
        reduce-scatter every micro-batch, which is what keeps their gradients sharded."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _reduces_now(self, b: Bucket) -> bool:
        return self.sync or self.zplan.grad_collectives(b)[0].phase == "backward"

    def on_grad(self, name: str, grad: Tensor) -> bool:
        """`grad` is the parameter's final gradient of this backward pass. Returns True when
        it is a view of the engine's bucket, which the caller must then leave in place."""
        self.in_backward = True
        b, s = self._slot[name]
        st = self.state[b.index]
        if st.grad_full is None:
            st.grad_full = self.ops.zeros(b.numel, self._dtype(b))
        st.grad_full = self.ops.pack(st.grad_full, 0, b.segment, s, grad, accumulate=True)
        st.ready.add(name)
        self._launch_ready(final=False)
        if self.gather is not None:
            self.gather.on_grad(self._unit[name], name)
        return st.grads_bound

    def _launch_ready(self, final: bool) -> None:
        while self._next_launch < len(self._reduce_order):
            b = self._reduce_order[self._next_launch]
            st = self.state[b.index]
            if not final and len(st.ready) < len(b.slots):
                return
            self._next_launch += 1
            # A bucket no gradient reached since the last flush (a pipeline flushing after
            # backwards that already reduced) has nothing to send; every rank sees the same.
            if self._reduces_now(b) and st.grad_full is not None:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        buf = self.state[b.index].grad_full
        if self.config.reduce_dtype != self._dtype(b):
            buf = self.ops.cast(buf, self.config.reduce_dtype)
        first = self.zplan.grad_collectives(b)[0]
        group = self._group(b, first.group)
        if group is None:
            handle = _Done()
        elif first.op == "reduce_scatter":
            handle = self.comm.reduce_scatter(buf, group, async_op=True)
        else:
            handle = self.comm.all_reduce(buf, group, async_op=True)
        self._inflight.append((b, buf, handle))

    def finish_backward(self) -> None:
        """Flush the remaining buckets, wait for the reductions, average, accumulate."""
        self._launch_ready(final=True)
        reduced = []
        for b, buf, handle in self._inflight:
            handle.wait()
            own = self.ops.read(buf, self._own_start(b), b.segment)
            follow = self.zplan.grad_collectives(b)[1:]
            second = None
            if follow and self._group(b, follow[0].group) is not None:
                second = self.comm.all_reduce(own, self._group(b, follow[0].group), async_op=True)
            reduced.append((b, own, second))
        for (b, own, second), (_, buf, _) in zip(reduced, self._inflight):
            if second is not None:
                second.wait()
            own = self.ops.scale(own, 1.0 / self.zplan.dp_cp_size)
            st = self.state[b.index]
            full = st.grad_full
            if self.zplan.stage >= 2 and b.sharded:
                st.grad_shard = (self.ops.cast(own, self._dtype(b)) if st.grad_shard is None
                                 else self.ops.add(st.grad_shard, own))
                st.grad_full = None
                self.ops.free(full)
            else:
                st.grad_full = self.ops.write(full, self._own_start(b), own)
            if buf is not full:
                self.ops.free(buf)
        self._inflight = []
        self._next_launch = 0
        for st in self.state.values():
            st.ready = set()
        if self.gather is not None:
            self.gather.finish_backward()
        self.in_backward = False

    # ---- optimizer step ----------------------------------------------------------------
    def _grad(self, b: Bucket) -> Tensor:
        st = self.state[b.index]
        if st.grad_shard is not None:
            return st.grad_shard
        if st.grad_full is not None:
            return self.ops.read(st.grad_full, self._own_start(b), b.segment)
        return self.ops.zeros(b.segment, self._dtype(b))

    def grad_norm(self, grads: dict[int, Tensor]) -> float:
        """Global L2 norm: each element counted once, on its primary rank."""
        total = self.ops.zeros(1, "float32")
        for b in self.buckets:
            total = self.ops.add(total, self.ops.sum_squares(grads[b.index], self.state[b.index].norm_ranges))
        if self.groups["world"] is not None:
            self.comm.all_reduce(total, self.groups["world"])
        return math.sqrt(self.ops.item(total))

    def step(self, lr: float, loss_scale: Optional[float] = None) -> Optional[float]:
        """Clip, update the owned segments, bring parameters up to date. Returns the gradient
        norm before clipping when clipping or loss scaling is on.

        `loss_scale`: the gradients are that multiple of the true ones (fp16 loss scaling,
        ms_llm.run.loss_scale). They are divided back (after the cast to the master dtype, where
        an fp16 gradient would underflow), and a non-finite global norm, the same on every
        rank, skips the update: parameters, optimizer states and the step count stay as they are."""
        cfg, ops = self.config, self.ops
        grads = {b.index: self._grad(b) for b in self.buckets}
        self._sum_tied(grads)
        norm = None
        if cfg.grad_clip > 0 or loss_scale is not None:
            norm = self.grad_norm(grads) / (loss_scale or 1.0)
        if loss_scale is not None and not math.isfinite(norm):
            for b in self.buckets:
                self._drop_grads(b)
            return norm
        coef = min(1.0, cfg.grad_clip / (norm + 1e-6)) if cfg.grad_clip > 0 else 1.0
        coef /= loss_scale or 1.0
        self.step_count += 1
        gathers = []
        for b in self.buckets:
            st = self.state[b.index]
            pbuf = None
            if st.master is not None:
                p = st.master
            elif st.param_shard is not None:
                p = st.param_shard
            elif st.param_full is not None:
                p = st.param_full
            else:
                pbuf = self._own_params(b)
                p = ops.read(pbuf, self._own_start(b), b.segment)
            g = grads[b.index]
            if st.master is not None:
                g = ops.cast(g, cfg.master_dtype, host=cfg.offload)
            if coef != 1.0:
                g = ops.scale(g, coef)
            if isinstance(cfg.optimizer, AdamW):
                p, st.m, st.v = ops.adamw(p, g, st.m, st.v, self.step_count, lr, cfg.optimizer, st.decay)
            else:
                p = ops.sgd(p, g, lr, cfg.optimizer, st.decay)
            if st.master is not None:
                st.master = p
            if st.param_shard is not None:
                st.param_shard = ops.write(st.param_shard, 0, p)
            elif st.param_full is not None:
                st.param_full = ops.write(st.param_full, 0, p)
            else:
                if pbuf is None:
                    pbuf = ops.empty(b.numel, self._dtype(b))     # the owned segment comes next, whole
                pbuf = ops.write(pbuf, self._own_start(b), p)
                gathers.append((b, pbuf, self.gather_bucket(b, pbuf)))
            self._drop_grads(b)
        for b, pbuf, handle in gathers:
            handle.wait()
            for s in b.slots:
                ops.unpack(pbuf, 0, b.segment, s, self.params[s.name])
            ops.free(pbuf)
        return norm

    def _sum_tied(self, grads: dict[int, Tensor]) -> None:
        """The embedding group: the first stage's embedding and its tied copy on the MTP modules'
        stage hold the same elements at the same shard index, each reduced over its own dp ranks;
        summed, both take the whole gradient and the same update (the copy is not in the norm)."""
        group = self.groups.get("embedding")
        if group is None:
            return
        for b in self.buckets:
            for s in b.slots:
                if s.name in self._tied:
                    g = self.ops.read(grads[b.index], s.offset, s.numel)
                    self.comm.all_reduce(g, group)
                    grads[b.index] = self.ops.write(grads[b.index], s.offset, g)

    def _drop_grads(self, b: Bucket) -> None:
        """After the step: free the gradient buffers, or zero the one the model's gradients
        are views of (and bind them again, should anything have replaced them)."""
        st, ops = self.state[b.index], self.ops
        if st.grads_bound:
            st.grad_full = ops.clear(st.grad_full)
            ops.bind(st.grad_full, b.slots, [self.params[s.name] for s in b.slots], grads=True)
        elif st.grad_full is not None:
            ops.free(st.grad_full)
            st.grad_full = None
        if st.grad_shard is not None:
            ops.free(st.grad_shard)
            st.grad_shard = None

    def gather_bucket(self, b: Bucket, pbuf: Tensor) -> Handle:
        if not b.sharded or self._group(b, "shard") is None:
            return _Done()
        return self.comm.all_gather_into(pbuf, self._group(b, "shard"), async_op=True)

    # ---- accounting --------------------------------------------------------------------
    def model_state_bytes(self, experts: Optional[bool] = None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states this rank holds right now
        (device), and optimizer states in host memory; `experts` True / False: of the routed
        experts' buckets / of the others only."""
        ops, out = self.ops, {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
        for b in self.buckets:
            if experts is not None and b.expert != experts:
                continue
            st = self.state[b.index]
            if st.param_shard is not None:
                out["params"] += ops.nbytes(st.param_shard)
            elif st.param_full is not None:
                out["params"] += ops.nbytes(st.param_full)
            else:
                out["params"] += sum(ops.nbytes(self.params[s.name]) for s in b.slots)
            out["grads"] += sum(ops.nbytes(t) for t in (st.grad_full, st.grad_shard) if t is not None)
            states = sum(ops.nbytes(t) for t in (st.master, st.m, st.v) if t is not None)
            out["host" if self.config.offload else "optimizer"] += states
        return out

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters this rank's engine manages (its pipeline stage's), in buffer order."""
        return tuple(self._slot)


class _Done:
    """Handle of a collective over a group of one rank: nothing to wait for."""
    def wait(self) -> None:
        return None


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)
