"""Lower a ModelPlan to the torch backend's terms: mesh, pipeline chunks, TP/SP styles, AC,
data-parallel engine, precision, schedule. Pure data, no torch import: `ms-llm train --backend
torch --dry-run` prints it (dry_run.py) and apply.py turns it into modules on each rank.

Nothing here names a LLaMA layer. Each weight's placement on the tp axis, and the tp
placement of the activations around it, pick the tensor-parallel style:

    weight Shard(0), kind embedding   -> rowwise   (vocab-parallel embedding)
    weight Shard(0), kind head        -> colwise   (vocab-parallel logits for loss_parallel)
    weight Shard(0), kind column      -> colwise
    weight Shard(1), kind row         -> rowwise   (output in the residual-stream layout)
    replicated norm, residual stream sharded on the sequence -> sequence
    bias Shard(0)                     -> none      (its module's colwise shards it with the weight)
    replicated head_norm              -> sequence over the heads dim of "q" (its gradient sums over tp)
    replicated latent                 -> latent    (kv_a_proj_with_mqa: the rotary key its heads read
                                                    directly has its gradient summed over tp), else none
    replicated latent_norm            -> none      (whole latent in, whole latent out)
    weight Shard(0), kind mtp_proj    -> colwise   (output gathered: the MTP layer's residual stream)

and where a block's input layout ("attn_input", "mlp_input") differs from the residual
stream ("hidden"), a prepare_input on the block redistributes it (the all-gather of
sequence parallelism; its reduce-scatter is the row-parallel output layout).

What the torch backend can run, and with which data-parallel engine, is
torch_backend.support's answer; lower() asks again, before any worker allocates memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ms_llm.errors import StrategyError
from ms_llm.machine import Machine
from ms_llm.strategy.cost import cp_algorithm
from ms_llm.strategy.layout import Placement, Replicate, Shard, TensorLayout
from ms_llm.strategy.mesh import MeshSpec
from ms_llm.strategy.plan import ChunkPlan, ModelPlan, ParamPlan, RecomputeMode
from torch_backend import support

StyleKind = Literal["colwise", "rowwise", "sequence", "prepare_input", "latent"]

# Which activation of the plan a block (by its attribute name) takes as input.
BLOCK_INPUT = {"self_attn": "attn_input", "mlp": "mlp_input", "shared_experts": "mlp_input"}
# The last dimension, whatever the rank of the tensor: where column / row parallel split features.
FEATURES = Shard(-1)
# Each schedule of the IR (ms_llm.strategy.ir.SCHEDULES) -> the torch.distributed.pipelining class that runs it.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
# Selective recompute keeps these ops' outputs (matmuls, and collectives so TP communication is
# not repeated) and recomputes the cheap rest: attention core, norms, rotary, SwiGLU activation.
SELECTIVE_SAVES = ("aten.mm.default", "aten.addmm.default",
                   "_c10d_functional.all_gather_into_tensor.default",
                   "_c10d_functional.reduce_scatter_tensor.default",
                   "_c10d_functional.all_reduce.default")


@dataclass(frozen=True)
class TpStyle:
    """One module's tensor-parallel style (a DTensor ParallelStyle), placements on the tp axis.
    prepare_input: `input` is the layout the block is given, `output` the one it wants.
    latent: a replicated module whose last `shared` output features every rank's heads read
    without a column-parallel module in between, so their gradient is summed over tp."""
    module: str                    # FQN, e.g. model.layers.3.self_attn.q_proj
    kind: StyleKind
    input: Placement
    output: Placement
    use_local_output: bool         # False: the output stays a DTensor (vocab-parallel logits, SP norms)
    shared: int = 0

    def __str__(self) -> str:
        # Column / row parallel hand on local tensors unless told otherwise; say when told.
        dtensor = not self.use_local_output and self.kind in ("colwise", "rowwise")
        shared = f", gradient of the last {self.shared} features summed over tp" if self.shared else ""
        return f"{self.kind}: in {self.input} out {self.output}" + (", DTensor out" if dtensor else "") + shared


@dataclass(frozen=True)
class DataParallelPlan:
    """The engine torch_backend.support.zero_engine picked, with the settings it is built with."""
    engine: str                    # one of support.ENGINES
    zero_stage: int
    mesh_axes: tuple[str, ...]     # the mesh (or group) it spans; () for none and shared (ms_llm.zero's groups)
    reshard_after_forward: bool    # FSDP2: ZeRO-3 frees parameters after each layer's forward
    param_dtype: str               # FSDP2 / replicate MixedPrecisionPolicy: parameters as computed with
    reduce_dtype: str              # gradient reduction (DDP: its compression hook when not float32)
    bucket_mb: float               # DDP gradient buckets


@dataclass(frozen=True)
class ContextParallelPlan:
    """Attention across the cp group (torch_backend/parallelize/cp.py); 'auto' already resolved."""
    degree: int
    algorithm: str                 # ring | ulysses | allgather
    balanced: bool                 # the 2*cp zigzag split (ring, allgather) or contiguous (ulysses)


@dataclass(frozen=True)
class TorchLowering:
    mesh: MeshSpec                              # init_device_mesh over these axes (size-1 included)
    stages: tuple[tuple[ChunkPlan, ...], ...]   # pp rank -> its chunks, in virtual order
    tp: tuple[TpStyle, ...]                     # every module's style, whole model; () when tp = 1
    loss_parallel: bool                         # vocab-parallel cross entropy over tp-sharded logits
    recompute: tuple[RecomputeMode, ...]        # per decoder layer
    selective_saves: tuple[str, ...]            # torch.ops names selective recompute keeps
    dp: DataParallelPlan
    compute_dtype: str                          # autocast dtype (float32: no autocast)
    schedule: Optional[str]                     # torch.distributed.pipelining class; None when pp = 1
    micro_batches: int
    compile: bool                               # torch.compile per decoder layer
    cp: Optional[ContextParallelPlan]           # None when cp = 1
    expert_mesh: Optional[MeshSpec] = None      # MoE: pp x edp x ep x etp, the expert groups


def tp_placement(layout: TensorLayout) -> Placement:
    """The layout's placement on the tp axis."""
    return layout.placements[layout.mesh.names.index("tp")]


def rotary_key_features(plan: ModelPlan, p: ParamPlan) -> int:
    """Trailing output features of an MLA down-projection that every head reads as is: the
    rotary key kv_a_proj_with_mqa appends to the kv latent. The rest of a latent reaches the
    heads through a column-parallel up-projection, whose input gradient DTensor already sums."""
    return plan.model.mla.qk_rope_head_dim if p.name.endswith("kv_a_proj_with_mqa.weight") else 0


def tp_plan(plan: ModelPlan) -> tuple[TpStyle, ...]:
    """Module FQN -> style, in parameter order, for the whole model."""
    acts = plan.activations
    hidden = tp_placement(acts["hidden"])
    styles: dict[str, TpStyle] = {}
    for p in plan.params.values():
        if p.kind in ("expert_column", "expert_row", "router"):
            continue       # torch_backend.parallelize.ep: the MoE layer splits its experts itself (over etp)
        fqn, weight = p.name.removesuffix(".weight"), tp_placement(p.layout)
        if p.kind == "embedding" and weight == Shard(0):
            styles[fqn] = TpStyle(fqn, "rowwise", tp_placement(acts["tokens"]), hidden, True)
        elif p.kind == "head" and weight == Shard(0):
            logits = tp_placement(acts["logits"])
            # Keep the vocab-sharded DTensor: loss_parallel computes the loss without gathering it.
            styles[fqn] = TpStyle(fqn, "colwise", hidden, logits, logits == Replicate())
        elif p.kind == "column" and weight == Shard(0):
            block = fqn.rsplit(".", 1)[0]                          # model.layers.3.self_attn
            want = tp_placement(acts[BLOCK_INPUT[block.rsplit(".", 1)[-1]]])
            if want != hidden:
                styles[block] = TpStyle(block, "prepare_input", hidden, want, False)
            styles[fqn] = TpStyle(fqn, "colwise", Replicate(), FEATURES, True)
        elif p.kind == "row" and weight == Shard(1):
            styles[fqn] = TpStyle(fqn, "rowwise", FEATURES, hidden, True)
        elif p.kind == "norm" and weight == Replicate():
            if hidden != Replicate():
                styles[fqn] = TpStyle(fqn, "sequence", hidden, hidden, False)
        elif p.kind == "bias" and weight == Shard(0):
            continue
        elif p.kind == "mtp_proj" and weight == Shard(0):
            # Megatron's MultiTokenPredictionLayer: column-parallel, its output gathered.
            styles[fqn] = TpStyle(fqn, "colwise", hidden, Replicate(), True)
        elif p.kind == "latent" and weight == Replicate():
            shared = rotary_key_features(plan, p)
            if shared:
                styles[fqn] = TpStyle(fqn, "latent", Replicate(), Replicate(), True, shared)
        elif p.kind == "latent_norm" and weight == Replicate():
            continue
        elif p.kind == "head_norm" and weight == Replicate():
            heads = tp_placement(acts["q"])
            styles[fqn] = TpStyle(fqn, "sequence", heads, heads, True)
        elif weight != Replicate():
            raise StrategyError(f"{p.name}: no tensor-parallel style for a {p.kind} weight placed "
                                f"{weight} on tp; the torch backend lowers column / row / embedding / head")
    return tuple(styles.values())


def data_parallel_plan(plan: ModelPlan, engine: str) -> DataParallelPlan:
    s, zero = plan.strategy, plan.zero
    # cp ranks hold the same parameters and see different tokens: gradients reduce over dp x cp.
    cp = "_cp" if s.cp > 1 else ""
    if engine in (support.DDP, support.ZERO_OPTIMIZER, support.REPLICATE):
        axes: tuple[str, ...] = ("dp" + cp,)
    elif engine == support.FSDP:
        # HSDP when shard groups are replicated: a 2-D (replicate, shard) mesh.
        axes = ("dp_replicate", "dp_shard" + cp) if zero.replicate_size > 1 else ("dp_shard" + cp,)
    else:
        axes = ()
    return DataParallelPlan(engine, zero.stage, axes, reshard_after_forward=zero.stage == 3,
                            param_dtype=s.precision.param_dtype, reduce_dtype=s.precision.grad_reduce_dtype,
                            bucket_mb=s.zero.bucket_mb)


def context_parallel_plan(plan: ModelPlan) -> Optional[ContextParallelPlan]:
    s = plan.strategy
    if s.cp == 1:
        return None
    algorithm = cp_algorithm(plan)
    return ContextParallelPlan(s.cp, algorithm, balanced=algorithm != "ulysses")


def lower(plan: ModelPlan, machine: Machine) -> TorchLowering:
    """Everything torch needs to run `plan` on `machine`; StrategyError when it cannot."""
    support.check(plan, machine)
    s = plan.strategy
    return TorchLowering(
        mesh=plan.mesh,
        stages=tuple(plan.chunks_of_stage(r) for r in range(s.pp)),
        tp=tp_plan(plan) if s.tp > 1 else (),
        loss_parallel=s.tp > 1,
        recompute=plan.recompute,
        selective_saves=SELECTIVE_SAVES if "selective" in plan.recompute else (),
        dp=data_parallel_plan(plan, support.zero_engine(plan, machine)),
        compute_dtype=s.precision.compute_dtype,
        schedule=SCHEDULES[s.pipeline.schedule] if s.pp > 1 else None,
        micro_batches=plan.micro_batches,
        compile=plan.train.compile,
        cp=context_parallel_plan(plan),
        expert_mesh=plan.expert_mesh,
    )
