"""Human (table) and machine (JSON) views of a ModelPlan and its cost estimate."""
from __future__ import annotations

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.strategy.cost import StepEstimate
from ms_llm.strategy.devices import DeviceSpec
from ms_llm.strategy.mesh import DENSE_AXES
from ms_llm.strategy.plan import ModelPlan

GB = 1e9


def count_text(count: int) -> str:
    """A count as people say it: '3.4M', '6.74B', '671B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count}"


def params_text(count: int) -> str:
    """A parameter count as people say it: '3.4M params', '6.74B params'."""
    return f"{count_text(count)} params"


def model_params_text(m: ModelConfig) -> str:
    """The model's size as its authors state it: all parameters, those a token activates (MoE), and
    the multi-token prediction modules apart ('671B params, 37.6B activated + 11.6B MTP (688M
    activated)'; DeepSeek-V3's 671B leaves the MTP module out)."""
    text = params_text(m.num_params(mtp=False))
    if m.moe is not None:
        text += f", {count_text(m.active_params(mtp=False))} activated"
    if m.mtp_layers:
        mtp_active = m.active_params() - m.active_params(mtp=False)
        text += f" + {count_text(m.mtp_param_count())} MTP"
        if m.moe is not None:
            text += f" ({count_text(mtp_active)} activated)"
    return text


def counted(n: int, noun: str, plural: str = "") -> str:
    """'1 group', '2 groups'; '1 micro-batch', '4 micro-batches'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _ranges(values: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def strategy_summary(plan: ModelPlan) -> str:
    s = plan.strategy
    parts = [f"dp{s.dp}" + (f" (zero-{s.zero.stage}, shard {plan.zero.group_size}"
                            + (f", {plan.zero.replicate_size} replicas" if plan.zero.replicate_size > 1 else "")
                            + ")" if s.zero.stage else "")]
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(s, name) > 1:
            parts.append(f"{name}{getattr(s, name)}")
    if plan.model.moe is not None and s.etp != s.tp:          # etp = tp goes without saying (the default)
        parts.append(f"etp{s.etp}")
    if s.pp > 1:
        parts.append(f"{s.pipeline.schedule} x{s.pipeline.virtual_stages} chunks")
    if s.sequence_parallel:
        parts.append("sequence-parallel")
    if s.recompute.policy != "none":
        parts.append(f"recompute {s.recompute.policy}" + (f" ({counted(s.recompute.num_layers, 'layer')} a stage)"
                                                          if s.recompute.num_layers != -1 else ""))
    p = s.precision
    parts.append(f"{p.param_dtype} params / {p.compute_dtype} compute / {p.master_dtype} master")
    if s.offload.optimizer or s.offload.params:
        parts.append("offload " + "+".join(k for k in ("optimizer", "params") if getattr(s.offload, k)))
    return ", ".join(parts)


def stage_map_lines(plan: ModelPlan) -> list[str]:
    lines = []
    for stage in range(plan.strategy.pp):
        pieces = []
        for c in plan.chunks_of_stage(stage):
            what = (["embed"] if c.has_embedding else []) + [f"layers {_ranges(list(c.layers))}"] + \
                   (["norm+lm_head"] if c.has_head else []) + (["mtp"] if c.has_mtp else [])
            pieces.append(f"chunk {c.virtual}: " + ", ".join(what))
        lines.append(f"  stage {stage}: " + "; ".join(pieces))
    return lines


def plan_report(plan: ModelPlan, est: StepEstimate, device: DeviceSpec) -> str:
    s, m, t = plan.strategy, plan.model, plan.train
    mem = est.memory
    L = [f"ms-llm plan: {m.name} ({model_params_text(m)}) on {plan.world_size} x {device.name}",
         f"strategy   {strategy_summary(plan)}",
         f"mesh       {plan.mesh.describe()}  (rank order {'-'.join(DENSE_AXES)}, row-major, tp fastest)"]
    shown = min(plan.world_size, 8)
    for r in range(shown):
        c = plan.mesh.coords(r)
        L.append(f"  rank {r:<4} " + " ".join(f"{k}={v}" for k, v in c.items() if plan.mesh.axis_size(k) > 1))
    if plan.world_size > shown:
        L.append(f"  ... {plan.world_size - shown} more ranks")
    groups = []
    for axis in ("tp", "cp", "dp", "pp"):
        if plan.mesh.axis_size(axis) > 1:
            g = plan.mesh.groups(axis)
            groups.append(f"{axis}: {counted(len(g), 'group')} of {len(g[0])}, rank 0 in {g[0]}")
    if groups:
        L.append("groups     " + "; ".join(groups))
    if plan.expert_mesh is not None:
        em, ez = plan.expert_mesh, plan.expert_zero
        sharded = [w for w, on in (("optimizer states", ez.shard_optimizer), ("gradients", ez.shard_grads),
                                   ("weights", ez.shard_params)) if on]
        zero = f"; zero-{ez.stage} over edp {ez.group_size}: {', '.join(sharded)}" if ez.stage else ""
        L.append(f"experts    {em.describe()}  (the same ranks folded, etp fastest{zero})")
        groups = []
        for axis in ("etp", "ep", "edp"):        # the expert process groups, by name
            if em.axis_size(axis) > 1:
                g = em.groups(axis)
                groups.append(f"{axis}: {counted(len(g), 'group')} of {len(g[0])}, rank 0 in {g[0]}")
        if groups:
            L.append("           " + "; ".join(groups))
    L.append(f"batch      global {t.global_batch_size} = micro {t.micro_batch_size} x dp {s.dp} x "
             f"{counted(plan.micro_batches, 'micro-batch', 'micro-batches')}; seq {t.seq_len}; {est.tokens_per_step:,} tokens/step")
    L.append("")
    L.append(f"memory per device (busiest: pipeline stage {mem.stage}, {mem.in_flight_micro_batches:g} "
             "micro-batches in flight)")
    for name, value in mem.components().items():
        if value:
            L.append(f"  {name:<22}{value / GB:>10.2f} GB")
    if mem.experts:
        L.append(f"  {'(of which experts)':<22}{mem.experts / GB:>10.2f} GB")
    if mem.host_offload:
        L.append(f"  {'(host offload)':<22}{mem.host_offload / GB:>10.2f} GB")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    L.append(f"  {'total':<22}{mem.total / GB:>10.2f} GB of {device.memory_bytes / GB:.0f} GB  ({verdict})")
    L.append("")
    L.append("communication per device per step")
    if not est.comm.bytes_by_axis:
        L.append("  none (single device)")
    for axis, nbytes in est.comm.bytes_by_axis.items():
        L.append(f"  {axis:<6}{nbytes / GB:>10.2f} GB  exposed {est.exposed_comm_s.get(axis, 0.0):7.3f} s  "
                 f"{est.comm.collective_by_axis[axis]}")
    L.append("")
    L.append(f"time       compute {est.compute_s:.3f} s + bubble {est.bubble_s:.3f} s + exposed comm "
             f"{sum(est.exposed_comm_s.values()):.3f} s = step {est.step_s:.3f} s")
    L.append(f"           MFU {100 * est.mfu:.1f}%, {est.tokens_per_s_per_device:,.0f} tokens/s/device")
    L.append("")
    L.append(f"layer -> stage ({plan.strategy.pp} stages x {s.pipeline.virtual_stages} chunks)")
    L.extend(stage_map_lines(plan))
    for note in plan.notes:
        L.append(f"note: {note}")
    return "\n".join(L)


def plan_json(plan: ModelPlan, est: StepEstimate, device: DeviceSpec) -> dict:
    mem, m = est.memory, plan.model
    return {
        "model": to_dict(plan.model, full=True),
        "strategy": to_dict(plan.strategy, full=True),
        "world_size": plan.world_size,
        "device": device.name,
        "mesh": {"names": list(plan.mesh.names), "shape": list(plan.mesh.shape)},
        "expert_mesh": ({"names": list(plan.expert_mesh.names), "shape": list(plan.expert_mesh.shape)}
                        if plan.expert_mesh is not None else None),
        "micro_batches": plan.micro_batches,
        "memory_bytes": {**mem.components(), "total": mem.total, "host_offload": mem.host_offload,
                         "experts": mem.experts,
                         "stage": mem.stage, "device_capacity": device.memory_bytes, "fits": est.fits},
        "communication_bytes": est.comm.bytes_by_axis,
        "time_s": {"compute": est.compute_s, "bubble": est.bubble_s, "exposed_comm": est.exposed_comm_s,
                   "step": est.step_s},
        "mfu": est.mfu,
        "tokens_per_s_per_device": est.tokens_per_s_per_device,
        "param_counts": {"total": m.num_params(mtp=False), "activated": m.active_params(mtp=False),
                         "mtp": m.mtp_param_count(), "mtp_activated": m.active_params() - m.active_params(mtp=False)},
        "stages": [{"stage": c.stage, "chunk": c.virtual, "layers": list(c.layers),
                    "embedding": c.has_embedding, "head": c.has_head, "mtp": c.has_mtp} for c in plan.chunks],
        "params": {n: {"shape": list(p.shape), "stage": p.stage, "chunk": p.chunk,
                       "placements": list(p.layout.to_dtensor())} for n, p in plan.params.items()},
        "buffers": {n: {"shape": list(b.shape), "dtype": b.dtype, "stage": b.stage, "chunk": b.chunk,
                        "placements": list(b.layout.to_dtensor())} for n, b in plan.buffers.items()},
        "notes": list(plan.notes),
    }
