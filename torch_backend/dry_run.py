"""`ms-llm train --backend torch --dry-run`: the torch lowering as text, without importing torch.

Styles that differ only by layer index print once with the layer range ({0-79}), as the
MindSpore dry run prints its op strategies (ms_llm/mindspore/dry_run.py)."""
from __future__ import annotations

import re
from collections import OrderedDict

from ms_llm.strategy.mesh import DERIVED_AXES
from ms_llm.strategy.plan import ChunkPlan, ModelPlan
from ms_llm.strategy.report import _ranges, strategy_summary
from torch_backend import support
from torch_backend.lower import TorchLowering

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
STYLES = "colwise = ColwiseParallel, rowwise = RowwiseParallel, sequence = SequenceParallel, " \
         "prepare_input = PrepareModuleInput (in = given, out = desired)"
ENGINES = {support.NONE: "none (dp = 1)", support.SHARED: "ms_llm.zero (the shared ZeRO engine)",
           support.DDP: "DistributedDataParallel", support.ZERO_OPTIMIZER: "DDP + ZeroRedundancyOptimizer",
           support.REPLICATE: "FSDP2 replicate", support.FSDP: "FSDP2 fully_shard"}


def _layers(layers: list[int]) -> str:
    return "model.layers.{" + _ranges(layers).replace(", ", ",") + "}"


def tp_lines(low: TorchLowering) -> list[str]:
    """One line per module pattern and style, identical layers folded."""
    groups: "OrderedDict[tuple[str, str], list[int]]" = OrderedDict()
    for style in low.tp:
        m = LAYER.match(style.module)
        pattern = LAYER.sub("model.layers.{}.", style.module)
        groups.setdefault((pattern, str(style)), []).extend([int(m.group(1))] if m else [])
    return [f"  {pattern.replace('model.layers.{}', _layers(layers))}: {text}"
            for (pattern, text), layers in groups.items()]


def _chunk(c: ChunkPlan) -> str:
    parts = (["model.embed_tokens"] if c.has_embedding else []) + ([_layers(list(c.layers))] if c.layers else [])
    return f"chunk {c.index}: " + ", ".join(parts + (["model.norm", "lm_head"] if c.has_head else []))


def stage_lines(low: TorchLowering) -> list[str]:
    return [f"  pp rank {r}: " + "; ".join(_chunk(c) for c in chunks) for r, chunks in enumerate(low.stages)]


def recompute_line(low: TorchLowering) -> str:
    by_mode: "OrderedDict[str, list[int]]" = OrderedDict()
    for i, mode in enumerate(low.recompute):
        if mode != "none":
            by_mode.setdefault(mode, []).append(i)
    if not by_mode:
        return "activation checkpointing: none"
    text = "; ".join(f"{mode} {_layers(layers)}" for mode, layers in by_mode.items())
    saves = f" (selective keeps the outputs of {', '.join(low.selective_saves)})" if low.selective_saves else ""
    return f"activation checkpointing: {text}{saves}"


def dp_line(low: TorchLowering) -> str:
    dp = low.dp
    text = f"data parallel: {dp.engine} = {ENGINES[dp.engine]}, ZeRO {dp.zero_stage}"
    if dp.mesh_axes:
        text += " over " + " x ".join(dp.mesh_axes)
    if dp.engine == support.FSDP:
        text += f", reshard_after_forward={dp.reshard_after_forward}"
    if dp.engine in (support.FSDP, support.REPLICATE):
        text += f", MixedPrecisionPolicy(param_dtype={dp.param_dtype}, reduce_dtype={dp.reduce_dtype})"
    if dp.engine in (support.DDP, support.ZERO_OPTIMIZER):
        text += f", buckets {dp.bucket_mb:g} MB, gradients reduced in {dp.reduce_dtype}"
    return text


def dry_run_text(plan: ModelPlan, low: TorchLowering) -> str:
    mesh = low.mesh
    derived = [f"{n} = {' x '.join(axes)}" for n, axes in DERIVED_AXES.items() if all(a in mesh.names for a in axes)]
    out = [f"torch lowering of {plan.model.name}: {strategy_summary(plan)}",
           f"devices {mesh.size}, mesh {mesh.describe()}; nothing built (--dry-run)", "",
           f"init_device_mesh(device, {mesh.shape}, mesh_dim_names={mesh.names})",
           f"  flattened: {', '.join(derived)}", ""]
    if low.tp:
        out += [f"tensor parallel: parallelize_module over tp ({len(low.tp)} modules; placements on tp: S(d) = shard "
                "dim d, R = replicate, P = partial sum; {a-b} = every layer in the range)", f"  {STYLES}"]
        out += tp_lines(low)
    else:
        out.append("tensor parallel: none (tp = 1)")
    if low.cp is not None:
        split = "zigzag 2*cp chunks, rank i holds i and 2*cp-1-i" if low.cp.balanced else "contiguous"
        out.append(f"context parallel: {low.cp.algorithm} over cp ({low.cp.degree} ranks; sequence split {split})")
    out.append("loss: " + ("loss_parallel (vocab-parallel cross entropy)" if low.loss_parallel else "cross entropy"))
    out += ["", "pipeline chunks of each pp rank (chunk i = PipelineStage i):"]
    out += stage_lines(low)
    if low.schedule is not None:
        out.append(f"pipeline schedule: {low.schedule}, {low.micro_batches} micro-batches")
    else:
        out.append(f"gradient accumulation over {low.micro_batches} micro-batch(es)")
    out += ["", recompute_line(low), f"compile: {'torch.compile per decoder layer' if low.compile else 'off'}",
            f"autocast: {'off (float32)' if low.compute_dtype == 'float32' else low.compute_dtype}", dp_line(low)]
    return "\n".join(out)
