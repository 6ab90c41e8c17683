"""What the torch backend can run, and with which data-parallel / ZeRO engine.

Framework-free (numpy, stdlib, ms_llm core), so the launcher and `ms-llm plan --backend
torch` ask here before torchrun starts; lower() asks again in every worker and records the
engine `zero_engine` names, which apply() builds. Rules true for every backend live in ms_llm.strategy.validate.
Every refusal names the field and what to use instead.
"""
from __future__ import annotations

from typing import Optional

from ms_llm.errors import StrategyError
from ms_llm.machine import Machine
from ms_llm.strategy.plan import ModelPlan

# Engines, one class each in torch_backend.parallelize.dp.
NONE = "none"                              # dp = 1: gradients are complete after backward
SHARED = "shared"                          # ms_llm.zero, stages 0-3, the partition both backends share
DDP = "ddp"                                # native stage 0
ZERO_OPTIMIZER = "ddp+zero_redundancy_optimizer"   # native stage 1
REPLICATE = "replicate"                    # native stage 0 under tp or pp (FSDP2's replicate)
FSDP = "fsdp2"                             # native stages 2 and 3
ENGINES = (NONE, SHARED, DDP, ZERO_OPTIMIZER, REPLICATE, FSDP)


def refusals(plan: ModelPlan, machine: Machine) -> list[str]:
    """Every reason the torch backend cannot run `plan` on `machine` (empty: it can). Torch runs
    on CUDA (NCCL) or on CPU (gloo) alike; Ascend NPUs are MindSpore's."""
    engine, problems = _engine(plan)
    problems = _lowering(plan) + _precision(plan) + problems
    if machine.accelerator == "ascend":
        problems.insert(0, "device: the torch backend runs on CUDA GPUs (NCCL) or CPUs (gloo), not on Ascend NPUs; "
                           "use --backend mindspore, or a job device of h100, h200, a100 or cpu")
    s = plan.strategy
    if s.offload.optimizer and engine != SHARED:
        more = " with dp > 1" if s.dp == 1 else ""
        problems.append(f"strategy.offload.optimizer: on torch only the shared ZeRO engine keeps optimizer states "
                        f"in host memory, this plan runs {engine!r}; set strategy.zero.engine: shared (or auto){more}")
    return problems


def check(plan: ModelPlan, machine: Machine) -> None:
    """Raise one StrategyError listing every refusal."""
    problems = refusals(plan, machine)
    if problems:
        raise StrategyError(problems)


def zero_engine(plan: ModelPlan, machine: Machine) -> str:
    """The engine (one of ENGINES) that runs the plan's data parallelism. strategy.zero.engine
    'auto' = shared wherever its torch adapter supports the plan, native otherwise."""
    engine, problems = _engine(plan)
    if problems:
        raise StrategyError(problems)
    return engine


def _lowering(plan: ModelPlan) -> list[str]:
    s, problems = plan.strategy, []
    if plan.model.moe is not None and s.sequence_parallel:
        problems.append("strategy.sequence_parallel: the torch MoE layer routes the whole sequence of each rank; "
                        "use sequence_parallel: false with model.moe")
    if plan.model.mtp_layers and s.pp > 1 and len(plan.embedding_stages()) == 1:
        problems.append(f"strategy.pipeline.schedule: {s.pipeline.schedule} puts the MTP modules on the first "
                        "rank beside the embedding (DualPipe's placement); the torch backend keeps their copy of "
                        "the embedding on another stage only; use schedule 1f1b, gpipe or interleaved_1f1b with MTP")
    if plan.model.mtp_layers and s.cp > 1:
        problems.append("strategy.cp: the MTP modules shift each sequence by up to mtp_layers tokens, across the "
                        "shards of the cp ranks, which the torch backend does not exchange; use cp: 1 with "
                        "model.mtp_layers")
    if plan.model.mla is not None and s.cp > 1:
        problems.append("strategy.cp: the torch backend's context-parallel attention cores are not wired into "
                        "multi-latent attention; use cp: 1 with model.mla")
    if s.sequence_parallel and (plan.model.mla is not None or plan.model.mtp_layers):
        problems.append("strategy.sequence_parallel: the torch backend computes MLA's latents and the MTP modules' "
                        "inputs on whole sequences; use sequence_parallel: false with model.mla or mtp_layers")
    if plan.model.tie_embeddings and s.tp > 1:
        problems.append("model.tie_embeddings: a tied embedding cannot be both the vocab-parallel embedding "
                        "and head in the torch backend; untie it or use tp: 1")
    if s.offload.params:
        problems.append("strategy.offload.params: the torch backend does not offload parameters yet; set it false")
    return problems


def _precision(plan: ModelPlan) -> list[str]:
    prec, problems = plan.strategy.precision, []
    if prec.master_dtype != "float32":
        problems.append(f"strategy.precision.master_dtype: the torch backend keeps float32 master weights, "
                        f"got {prec.master_dtype}; set float32")
    return problems


def _engine(plan: ModelPlan) -> tuple[str, list[str]]:
    """(engine, why it cannot run): the choice is made even when refused, so every refusal
    that follows from it is reported at once."""
    s = plan.strategy
    # cp ranks see different tokens: their gradients are reduced too. Experts split over tp are
    # plain tensors that the shared engine alone (its experts' buckets) counts whole in the global norm.
    if s.dp * s.cp == 1 and not (plan.model.moe is not None and s.tp > 1):
        return NONE, []
    problem = _shared_problem(plan)
    if plan.model.moe is not None and s.zero.engine == "native":
        return _native_moe(plan)
    if plan.model.moe is not None:
        return SHARED, [f"{problem}; MoE runs on the shared engine"] if problem else []
    if s.zero.engine == "shared" or (s.zero.engine == "auto" and problem is None):
        return SHARED, [f"{problem}; use strategy.zero.engine: native (or auto)"] if problem else []
    return _native(plan)


def _native_moe(plan: ModelPlan) -> tuple[str, list[str]]:
    """FSDP2 shards the routed experts over edp apart from the dense weights (parallelize.dp.FSDP);
    DDP and ZeroRedundancyOptimizer would average different ranks' experts together."""
    engine, problems = _native(plan)
    if engine != FSDP:
        problems.append("strategy.zero.engine: MoE experts are reduced over their expert-data-parallel group by "
                        "FSDP2 (native zero.stage 2 or 3) or the shared engine; set stage 2 or 3, or use engine "
                        "shared (or auto)")
    elif plan.zero.replicate_size > 1:
        problems.append("strategy.zero.shard_size: FSDP2 shards MoE experts over all of edp, not hybrid; use "
                        "shard_size -1 or engine shared")
    return engine, problems


def _shared_problem(plan: ModelPlan) -> Optional[str]:
    """Why the shared engine's torch adapter cannot run this plan (None: it can)."""
    s = plan.strategy
    if s.pp > 1 and s.pipeline.schedule in ("zero_bubble", "zbv"):
        # Their split weight-gradient pass sets .grad outside autograd's accumulation hooks.
        return (f"strategy.pipeline.schedule: {s.pipeline.schedule} computes weight gradients outside the "
                "hooks the shared ZeRO engine collects them from")
    return None


def _native(plan: ModelPlan) -> tuple[str, list[str]]:
    """torch's own engines: DDP / ZeroRedundancyOptimizer / FSDP2 replicate / fully_shard."""
    s, zero, problems = plan.strategy, plan.zero, []
    model_parallel = s.tp > 1 or s.pp > 1
    if s.precision.grad_reduce_dtype == "bfloat16" and zero.stage < 2 and not model_parallel:
        problems.append("strategy.precision.grad_reduce_dtype: DDP's bf16 gradient compression needs CUDA and "
                        "is not wired here; use float32 (or float16), or engine shared")
    if zero.stage in (1, 2) and zero.replicate_size > 1 and zero.group_size > 1:
        problems.append(f"strategy.zero.shard_size: hybrid sharding below stage 3 needs engine 'shared' (torch's "
                        f"native stage 1/2 shard over all of dp = {s.dp}); use engine shared, zero.stage 3 or "
                        "shard_size -1")
    if zero.stage == 0 or zero.group_size == 1:
        return (REPLICATE if model_parallel else DDP), problems
    if zero.stage == 1:
        if s.tp > 1:
            problems.append("strategy.zero.stage: torch's native stage-1 optimizer does not take "
                            "tensor-parallel parameters; use stage 2/3 (FSDP2) or engine 'shared'")
        if s.pp > 1:
            problems.append("strategy.zero.engine: torch's native stage-1 optimizer does not compose with "
                            "pipeline parallel; use engine 'shared' or zero.stage 2/3")
        return ZERO_OPTIMIZER, problems
    return FSDP, problems
