"""Data parallelism and ZeRO: one small interface, several engines behind it.

The trainer only ever calls, in this order:

    parts = dp.wrap(parts)                      once, after TP / AC / compile
    dp.tie_embedding(plan, parts)               once: the embedding group (MTP under pipeline parallel)
    optimizer = dp.make_optimizer(params, cls, kwargs)
    per step:
        with dp.sync(part, last):               around each micro-batch's forward + backward
        dp.reduce_grads(parts)                  after the last backward (and the embedding group's sum)
        norm = dp.step(optimizer, params, lr, grad_clip, pp_group, loss_scale)
                                                clip (fp16: unscale, skip on overflow), update, clear grads

Engines (torch_backend.support.zero_engine picks one per plan, before any process starts; the
lowering's DataParallelPlan carries it with its settings):
    shared  ms_llm's ZeRO engine (ms_llm.zero), stages 0-3, the same partition on both
            backends; 'auto' takes it wherever this adapter supports the strategy
    native  stage 0: DistributedDataParallel (FSDP2's `replicate` under tensor or pipeline
            parallelism); stage 1: DDP + ZeroRedundancyOptimizer; stage 2: FSDP2 fully_shard
            keeping parameters unsharded until backward; stage 3: fully_shard resharding
            after forward
The native engines import their torch modules when built: FSDP2 and ZeroRedundancyOptimizer
load DTensor, most of a second of every worker's start that the other engines do not need.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import TYPE_CHECKING, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ms_llm.strategy.plan import ModelPlan
from torch_backend import support
from torch_backend.clip import clip_grad_norm
from torch_backend.lower import DataParallelPlan
from torch_backend.mesh import Meshes
from torch_backend.moe import MoE
from torch_backend.parallelize.precision import DTYPES
from torch_backend.parallelize.tied import EmbeddingGroup, embedding_group

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


class DataParallel:
    """No data parallelism (dp = 1): gradients are complete after backward."""
    name = support.NONE
    embedding: Optional[EmbeddingGroup] = None     # this rank's embedding group, when it holds a copy

    def wrap(self, parts: list[nn.Module]) -> list[nn.Module]:
        return parts

    def tie_embedding(self, plan: ModelPlan, parts: list[nn.Module]) -> None:
        """Join the embedding group, where the plan copies the embedding to the MTP modules' stage."""
        self.embedding = embedding_group(plan, parts)

    def sync(self, part: nn.Module, last: bool) -> ContextManager:
        """Context for one micro-batch; `last` marks the one whose backward must reduce."""
        return nullcontext()

    def reduce_grads(self, parts: list[nn.Module]) -> None:
        """Engines that reduce inside backward have only the embedding copies' sum left to do."""
        if self.embedding is not None:
            self.embedding.sum_grads()

    def make_optimizer(self, params: Iterable, cls: type, kwargs: dict) -> Optional[torch.optim.Optimizer]:
        return cls(params, **kwargs)

    def gather_params(self) -> None:
        """Make every parameter of this rank readable (between steps, for export or checks)."""

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], lr: float, grad_clip: float,
             pp_group, loss_scale: Optional[float] = None) -> torch.Tensor:
        """Clip to the global norm, update, clear gradients; returns the norm before clipping.
        `loss_scale`: the gradients are that multiple of the true ones (fp16); they are divided
        back, and a non-finite norm (global, so every rank agrees) skips the update."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        copy = self.embedding.uncounted if self.embedding is not None else ()
        if loss_scale is None:
            norm = clip_grad_norm(params, grad_clip, pp_group, copy)
            optimizer.step()
        else:
            norm = unscale_and_clip(params, grad_clip, loss_scale, pp_group, copy)
            if torch.isfinite(norm):
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm


@torch.no_grad()
def unscale_and_clip(params: list[nn.Parameter], grad_clip: float, loss_scale: float, pp_group,
                     uncounted: tuple[nn.Parameter, ...] = ()) -> torch.Tensor:
    """Global norm of the true gradients; when finite, gradients become the true ones, clipped,
    in one multiply (grad_clip 0 = off)."""
    norm = clip_grad_norm(params, 0.0, pp_group, uncounted) / loss_scale
    if torch.isfinite(norm):
        to_true_clipped(params, norm, grad_clip, loss_scale)
    return norm


@torch.no_grad()
def to_true_clipped(params: list[nn.Parameter], norm: torch.Tensor, grad_clip: float, loss_scale: float) -> None:
    """Gradients that are `loss_scale` times the true ones, whose true global norm is `norm`,
    become the true ones clipped to `grad_clip` (0 = off), in one multiply."""
    coef = min(1.0, grad_clip / (norm.item() + 1e-6)) if grad_clip > 0 else 1.0
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef / loss_scale)


class DDP(DataParallel):
    """ZeRO-0: replicas all-reduce bucketed gradients during backward."""
    name = support.DDP

    def __init__(self, group, bucket_mb: float, grad_reduce_dtype: str):
        self.group, self.bucket_mb, self.grad_reduce_dtype = group, bucket_mb, grad_reduce_dtype

    def _wrap(self, part: nn.Module) -> nn.Module:
        # Buffers outside the state dict are derived on each rank (under context parallel, the
        # rotary rows of this rank's positions): DDP must not overwrite them with rank 0's.
        derived = set(dict(part.named_buffers())) - set(part.state_dict())
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, sorted(derived))
        ddp = DistributedDataParallel(part, process_group=self.group, bucket_cap_mb=self.bucket_mb,
                                      gradient_as_bucket_view=True, forward_sync_buffers=False)
        if self.grad_reduce_dtype != "float32":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            hook = {"float16": default_hooks.fp16_compress_hook,
                    "bfloat16": default_hooks.bf16_compress_hook}[self.grad_reduce_dtype]
            ddp.register_comm_hook(self.group, hook)
        return ddp

    def wrap(self, parts):
        return [self._wrap(part) for part in parts]

    def sync(self, part: nn.Module, last: bool) -> ContextManager:
        return nullcontext() if last else part.no_sync()


class ZeroOptimizer(DDP):
    """ZeRO-1: DDP reduces gradients; each rank updates its share of the parameters and
    broadcasts it (torch's ZeroRedundancyOptimizer)."""
    name = support.ZERO_OPTIMIZER

    def make_optimizer(self, params, cls, kwargs):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, process_group=self.group, **kwargs)


class Replicate(DataParallel):
    """ZeRO-0 where DDP does not fit: DTensor (tensor-parallel) parameters, which DDP cannot take,
    and pipeline stages, whose schedules drive FSDP2-style modules' reduction but not DDP's
    bucket rebuild. FSDP2's replicate: an all-reduce per parameter group in backward."""
    name = support.REPLICATE

    def __init__(self, mesh: DeviceMesh, mp: MixedPrecisionPolicy):
        self.mesh, self.mp = mesh, mp

    def wrap(self, parts):
        from torch.distributed._composable.replicate_with_fsdp import replicate
        return [replicate(part, mesh=self.mesh, mp_policy=self.mp) for part in parts]


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """How FSDP2 shards MoE's routed experts (torchtitan's efsdp): over `mesh`, the edp ranks holding the
    same expert shard, apart from the dense parameters' dp mesh. Their gradient on a rank already sums
    the tokens of every ep (and etp) peer, so the edp sum is divided by `divide`, the ranks that see
    different tokens (dp x cp), not by edp; their norm sums over `norm_groups` (ep, etp), whose ranks hold
    the other experts and widths."""
    mesh: DeviceMesh
    divide: int
    norm_groups: tuple[dist.ProcessGroup, ...]


class FSDP(DataParallel):
    """ZeRO-2 / 3 with FSDP2: one shard group per decoder layer plus one for the rest; with MoE, each
    layer's routed experts one more, over edp (`experts`)."""
    name = support.FSDP

    def __init__(self, mesh: DeviceMesh, reshard_after_forward: bool, mp: MixedPrecisionPolicy,
                 experts: Optional[ExpertSharding] = None):
        self.mesh, self.reshard, self.mp, self.experts = mesh, reshard_after_forward, mp, experts
        self.expert_params: set[int] = set()

    def _wrap(self, part: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        if self.experts is not None:          # every MoE layer's, the MTP modules' included
            for moe in (m for m in part.modules() if isinstance(m, MoE)):
                self._shard_experts(moe.experts)
        for layer in part.model.layers.values():
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=self.reshard, mp_policy=self.mp)
        return fully_shard(part, mesh=self.mesh, reshard_after_forward=self.reshard, mp_policy=self.mp)

    def _shard_experts(self, experts: nn.Module) -> None:
        """The experts' own shard group, before their layer's, which then leaves them out. Summed, then
        divided once (set_force_sum_reduction_for_comms: a plain sum, which gloo reduces too; not with
        edp 1, where FSDP2 copies the gradient divided and would divide the copy again)."""
        from torch.distributed.fsdp import fully_shard
        unit = fully_shard(experts, mesh=self.experts.mesh, reshard_after_forward=self.reshard, mp_policy=self.mp)
        unit.set_gradient_divide_factor(float(self.experts.divide))
        unit.set_force_sum_reduction_for_comms(self.experts.mesh.size() > 1)
        self.expert_params.update(id(p) for p in experts.parameters())

    def wrap(self, parts):
        return [self._wrap(part) for part in parts]

    def step(self, optimizer, params, lr, grad_clip, pp_group, loss_scale=None):
        if not self.expert_params:
            return super().step(optimizer, params, lr, grad_clip, pp_group, loss_scale)
        for group in optimizer.param_groups:
            group["lr"] = lr
        norm = self._grad_norm(params, pp_group) / (loss_scale or 1.0)
        if torch.isfinite(norm):
            to_true_clipped(params, norm, grad_clip, loss_scale or 1.0)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def _grad_norm(self, params: list[nn.Parameter], pp_group) -> torch.Tensor:
        """Global norm with the experts' squares summed over the ranks holding the other experts."""
        copy = self.embedding.uncounted if self.embedding is not None else ()
        dense = clip_grad_norm([p for p in params if id(p) not in self.expert_params], 0.0, None, copy) ** 2
        experts = clip_grad_norm([p for p in params if id(p) in self.expert_params], 0.0) ** 2
        experts = experts.to(params[0].device)
        for group in self.experts.norm_groups:
            dist.all_reduce(experts, group=group)
        total = dense.to(experts.device) + experts
        if pp_group is not None:
            dist.all_reduce(total, group=pp_group)
        return total.sqrt()


class SharedZero(DataParallel):
    """ms_llm's ZeRO engine: gradients leave autograd into its buckets, it reduces, clips and
    runs the optimizer on the owned shards itself (torch_backend.zero.ZeroDataParallel). MoE's
    routed experts are in its partition, over their expert-data-parallel groups."""
    name = support.SHARED

    def __init__(self, plan: ModelPlan, device: torch.device):
        from ms_llm.zero import zero_plan
        from ms_llm.zero.engine import EngineConfig

        # This backend holds parameters in master_dtype and casts for compute (autocast), so the
        # engine's buffers take that dtype and need no second (master) copy.
        prec = plan.strategy.precision
        held = dataclasses.replace(plan.strategy, precision=dataclasses.replace(prec, param_dtype=prec.master_dtype))
        plan = dataclasses.replace(plan, strategy=held)
        self.plan, self.device = plan, device
        self.zplan, self.config = zero_plan(plan), EngineConfig.from_job(plan.strategy, plan.train)
        self.engine = None

    def wrap(self, parts):
        from torch_backend.zero import ZeroDataParallel

        self.engine = ZeroDataParallel(parts, self.zplan, dist.get_rank(), self.config, self.device)
        return parts

    def tie_embedding(self, plan, parts):
        """The engine sums the embedding copies itself (ms_llm.zero: the copy is a tied entry)."""

    def sync(self, part, last):
        return nullcontext() if last else self.engine.no_sync()

    def reduce_grads(self, parts):
        """A pipeline schedule runs every micro-batch's backward under no_sync (its last backward
        is not the end of the step); this flushes the accumulated gradients."""
        if self.plan.strategy.pp > 1:
            self.engine.engine.finish_backward()

    def make_optimizer(self, params, cls, kwargs):
        return None              # the engine owns the optimizer states of its shards

    def gather_params(self):
        """ZeRO-3 frees parameters outside their layer's forward and backward."""
        if self.engine.engine.gather is not None:
            self.engine.engine.gather.gather_all()

    def step(self, optimizer, params, lr, grad_clip, pp_group, loss_scale=None):
        norm = self.engine.step(lr, loss_scale)
        return torch.tensor(float("nan") if norm is None else norm)


def mixed_precision(dp: DataParallelPlan) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=DTYPES[dp.param_dtype], reduce_dtype=DTYPES[dp.reduce_dtype])


def expert_sharding(plan: ModelPlan, meshes: Meshes) -> Optional[ExpertSharding]:
    """FSDP2's shard group of the routed experts (MoE only): edp, of the expert mesh."""
    s = plan.strategy
    if plan.model.moe is None:
        return None
    groups = tuple(meshes.expert_group(axis) for axis in ("ep", "etp") if getattr(s, axis) > 1)
    return ExpertSharding(meshes.expert["edp"], s.dp * s.cp, groups)


def _mesh(meshes: Meshes, axes: tuple[str, ...]) -> DeviceMesh:
    """One axis by name (derived ones, such as dp, are flattened meshes), several as a sub-mesh."""
    return meshes[axes[0]] if len(axes) == 1 else meshes[axes]


def build_data_parallel(dp: DataParallelPlan, plan: ModelPlan, meshes: Meshes, device: torch.device) -> DataParallel:
    """The engine the lowering names, over the mesh axes it names."""
    if dp.engine == SharedZero.name:
        return SharedZero(plan, device)
    if dp.engine == DDP.name:
        return DDP(_mesh(meshes, dp.mesh_axes).get_group(), dp.bucket_mb, dp.reduce_dtype)
    if dp.engine == ZeroOptimizer.name:
        return ZeroOptimizer(_mesh(meshes, dp.mesh_axes).get_group(), dp.bucket_mb, dp.reduce_dtype)
    if dp.engine == Replicate.name:
        return Replicate(_mesh(meshes, dp.mesh_axes), mixed_precision(dp))
    if dp.engine == FSDP.name:
        return FSDP(_mesh(meshes, dp.mesh_axes), reshard_after_forward=dp.reshard_after_forward, mp=mixed_precision(dp),
                    experts=expert_sharding(plan, meshes))
    return DataParallel()
