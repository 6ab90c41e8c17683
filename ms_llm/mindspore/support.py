"""What the MindSpore backend can run, and which engine runs its data parallelism / ZeRO.

Framework-free (imports no MindSpore), so the launcher and `ms-llm plan --backend
mindspore` answer before msrun starts, and the worker builds the engine `zero_engine` names.

Measured on MindSpore 2.10 (shared/reference/mindspore-cpu.md): only Ascend compiles
semi_auto_parallel, so without one (a CPU machine, or a GPU one: MindSpore runs on its
CPU there) MindSpore trains data parallel only; its parallel optimizer is Ascend-only, so
ZeRO there is ms_llm's shared engine over the CPU collectives, whose AllGather works only
over the world group; CPU has no bfloat16 MatMul. Every refusal names the field and what
to use instead.
"""
from __future__ import annotations

from ms_llm.errors import StrategyError
from ms_llm.machine import Machine
from ms_llm.mindspore.lower import SCHEDULES, cp_refusals
from ms_llm.strategy.plan import ModelPlan

NONE = "none"                              # dp = 1
GRAD_REDUCER = "grad_reducer"              # ZeRO-0: the compiled step all-reduces gradients itself
                                           # (DistributedGradReducer; semi_auto_parallel on Ascend)
SHARED = "shared"                          # ms_llm.zero in PyNative DATA_PARALLEL, stages 0-3
PARALLEL_OPTIMIZER = "parallel_optimizer"  # native ZeRO 1-3: semi_auto_parallel's optimizer sharding
ENGINES = (NONE, GRAD_REDUCER, SHARED, PARALLEL_OPTIMIZER)


def refusals(plan: ModelPlan, machine: Machine) -> list[str]:
    """Every reason MindSpore cannot run `plan` on `machine` (empty: it can)."""
    ascend = machine.accelerator == "ascend"
    problems = _model(plan) + _moe(plan, ascend)
    if not ascend:
        problems += _without_ascend(plan, machine)
    problems += _engine(plan, ascend)[1]
    if plan.train.memory_limit_gb:
        problems.append("train.memory_limit_gb: the MindSpore backend does not cap worker memory yet; set 0 "
                        "(or use --backend torch)")
    if plan.strategy.offload.optimizer or plan.strategy.offload.params:
        problems.append("strategy.offload: the MindSpore backend does not offload; set offload.optimizer and "
                        "offload.params false (or use --backend torch, whose shared engine offloads the optimizer)")
    return problems


def check(plan: ModelPlan, machine: Machine) -> None:
    """Raise one StrategyError listing every refusal."""
    problems = refusals(plan, machine)
    if problems:
        raise StrategyError(problems)


def zero_engine(plan: ModelPlan, machine: Machine) -> str:
    """The engine (one of ENGINES) for the plan's data parallelism. strategy.zero.engine 'auto'
    = the shared engine wherever it can run the plan (pure data parallel: it runs outside
    semi_auto_parallel), the parallel optimizer otherwise; at stage 0 nothing is sharded and
    the compiled step's own all-reduce is used unless 'shared' is asked for."""
    engine, problems = _engine(plan, machine.accelerator == "ascend")
    if problems:
        raise StrategyError(problems)
    return engine


def _auto_parallel_degrees(plan: ModelPlan) -> list[str]:
    """What only semi_auto_parallel runs: every split but data parallel's."""
    s = plan.strategy
    degrees = [f"{n}={getattr(s, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(s, n) > 1]
    if plan.model.moe is not None and s.etp > 1 and s.etp != s.tp:     # experts' width split apart from tp
        degrees.append(f"etp={s.etp}")
    return degrees + (["sequence_parallel"] if s.sequence_parallel else [])


def _model(plan: ModelPlan) -> list[str]:
    s, problems = plan.strategy, []
    if s.cp > 1:
        problems += cp_refusals(plan)
    if s.pp > 1 and s.pipeline.schedule not in SCHEDULES:
        problems.append(f"strategy.pipeline.schedule: MindSpore has no {s.pipeline.schedule!r} scheduler; "
                        f"use one of {', '.join(SCHEDULES)}")
    return problems


def _moe(plan: ModelPlan, ascend: bool) -> list[str]:
    """MoE trains through the compiled step (data parallel on CPU, every expert on every rank; under
    semi_auto_parallel on Ascend, lower_moe.py: experts over ep, tokens over edp) or, with ZeRO on CPU,
    through the shared engine, whose partition holds the experts over edp (= dp there). ZeRO on Ascend
    is the parallel optimizer, which splits each expert weight over the ranks holding its slice (edp)
    on its first dimension (lower.optimizer_shard_size)."""
    if plan.model.moe is None:
        return []
    moe, s, zero = plan.model.moe, plan.strategy, plan.zero
    engine, problems = _engine(plan, ascend)[0], []
    if ascend and moe.capacity_factor < 0 and not moe.use_gmm:
        problems.append("model.moe.capacity_factor: -1 (dropless) gives every expert a slot for every token on "
                        "Ascend (E / top_k times the expert work: moe.py's worst-case capacity); set use_gmm true "
                        "(dropless with GroupedMatmul, MindFormers' MoEV3) or a capacity factor, e.g. 1.25")
    if moe.use_gmm and not ascend:
        problems.append("model.moe.use_gmm: GroupedMatmul has only an Ascend kernel (MindSpore refuses it on the "
                        "CPU); set use_gmm false (dropless runs as the worst-case capacity), or run on Ascend")
    elif moe.use_gmm and (s.dp > 1 or _auto_parallel_degrees(plan)):
        split = ", ".join([f"dp={s.dp}"] * (s.dp > 1) + _auto_parallel_degrees(plan))
        problems.append(f"model.moe.use_gmm: runs on one Ascend device; under semi_auto_parallel ({split}) MoEV3's "
                        "expert stage (a Morph with AlltoAllV over ep around the GroupedMatmuls, on each rank's own "
                        "token group) is not lowered yet; use one device, or use_gmm false with a capacity factor")
    if engine == SHARED and moe.expert_bias:
        problems.append("model.moe.expert_bias: MindSpore's shared ZeRO engine (PyNative) does not move the "
                        "expert biases (the compiled step does); use zero.stage 0 without engine 'shared', or "
                        "--backend torch")
    if engine == PARALLEL_OPTIMIZER and plan.expert_zero.group_size > 1:
        edp = plan.expert_zero.group_size
        if zero.replicate_size > 1 and zero.group_size != edp:
            problems.append(f"strategy.zero.shard_size: MindSpore's parallel optimizer takes one shard size for "
                            f"every parameter (optimizer_weight_shard_size): {zero.group_size} for the dense ones "
                            f"(hybrid sharding) cannot split the routed experts over their edp = {edp}; use "
                            f"shard_size -1, or {edp}")
        if moe.num_experts % (s.ep * edp):
            problems.append(f"model.moe.num_experts: MindSpore's parallel optimizer splits an expert weight on its "
                            f"first dimension, the experts, over ep x edp = {s.ep} x {edp} (MindFormers asks the "
                            f"same), which {moe.num_experts} experts do not divide; change ep or the data-parallel "
                            "degrees, or use zero.stage 0")
    return problems


def _without_ascend(plan: ModelPlan, machine: Machine) -> list[str]:
    s, prec, problems = plan.strategy, plan.strategy.precision, []
    needs_auto = _auto_parallel_degrees(plan)
    if needs_auto:
        problems.append(
            f"strategy: {', '.join(needs_auto)} needs MindSpore's semi_auto_parallel, which ms_llm runs only on "
            f"Ascend (on this {machine.accelerator} machine MindSpore trains on the CPU, where semi_auto_parallel "
            "stops with 'Invalid communication backend'). Use data parallel (dp, zero.stage 0-3), run on an Ascend "
            "machine, use --backend torch, or add --dry-run to print the lowering")
    if prec.param_dtype != "float32":
        problems.append(f"strategy.precision.param_dtype: MindSpore on {machine.accelerator} holds float32 "
                        f"parameters, got {prec.param_dtype}; set float32 (for float16 compute set compute_dtype: "
                        f"float16 with loss_scale: dynamic; {prec.param_dtype} parameters need Ascend)")
    if prec.compute_dtype == "bfloat16":
        problems.append(f"strategy.precision.compute_dtype: MindSpore has no bfloat16 MatMul on "
                        f"{machine.accelerator}; use float32, or float16 with loss_scale: dynamic (bfloat16 runs "
                        "on Ascend)")
    if prec.grad_reduce_dtype != "float32":
        problems.append(f"strategy.precision.grad_reduce_dtype: MindSpore on {machine.accelerator} reduces the "
                        f"float32 gradients as they are, got {prec.grad_reduce_dtype}; set float32")
    return problems


def _engine(plan: ModelPlan, ascend: bool) -> tuple[str, list[str]]:
    """(engine, why it cannot run): the choice is made even when refused, so every refusal
    is reported at once."""
    s, zero, asked = plan.strategy, plan.zero, plan.strategy.zero.engine
    if s.dp == 1:
        return NONE, []
    if not ascend:                 # data parallel only (_without_ascend refuses the rest)
        if zero.stage == 0:
            return (SHARED if asked == "shared" else GRAD_REDUCER), []
        problems = []
        if asked == "native":
            problems.append("strategy.zero.engine: 'native' is MindSpore's parallel optimizer, which runs only on "
                            "Ascend; use engine 'shared' or 'auto' (ms_llm's ZeRO engine)")
        if zero.replicate_size > 1 and zero.group_size > 1:
            problems.append(f"strategy.zero.shard_size: {zero.group_size} < dp = {s.dp} (hybrid sharding) needs "
                            "AllGather inside each shard group, and MindSpore's CPU AllGather runs only over the "
                            "world group; use shard_size -1 (shard over all of dp) or run on Ascend")
        return SHARED, problems
    auto_parallel = _auto_parallel_degrees(plan)
    if asked == "shared" and auto_parallel:
        return SHARED, [f"strategy.zero.engine: the shared engine runs MindSpore in DATA_PARALLEL mode, which "
                        f"cannot take {', '.join(auto_parallel)}; use engine native (MindSpore's parallel "
                        "optimizer) or auto"]
    if zero.stage == 0:
        return (SHARED if asked == "shared" else GRAD_REDUCER), []
    # Ascend's own ZeRO (the parallel optimizer, sharded inside the compiled graph) unless the
    # shared engine is asked for by name.
    return (SHARED if asked == "shared" else PARALLEL_OPTIMIZER), []
