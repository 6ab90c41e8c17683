"""`ms-llm train --backend mindspore --dry-run`: the lowering as text, without compiling.

Ops that differ only by layer index and share strategies print once with the layer range
({0-79}); the stage map lists which cells each pipeline stage holds."""
from __future__ import annotations

import re
from collections import OrderedDict

from ms_llm.mindspore.lower import Lowering, cp_algorithm, flash_attention
from ms_llm.mindspore.op_strategy import OpShard
from ms_llm.strategy.report import _ranges, strategy_summary

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def op_lines(low: Lowering) -> list[str]:
    groups: "OrderedDict[tuple, list[int]]" = OrderedDict()
    for op in low.ops:
        m = LAYER.match(op.op)
        if not m:
            groups[(op.op, op.inputs, op.output, op.attrs, False)] = []
            continue
        key = (LAYER.sub("model.layers.{}.", op.op), op.inputs, op.output, op.attrs, True)
        groups.setdefault(key, []).append(int(m.group(1)))
    lines = []
    for (name, inputs, output, attrs, per_layer), layers in groups.items():
        if per_layer:
            name = name.replace("{}", "{" + _ranges(layers).replace(", ", ",") + "}")
        lines.append(f"  {OpShard(name, inputs, output, attrs)}")
    return lines


def _cells(paths: list[str]) -> str:
    """Cell paths in model order, consecutive decoder layers folded into one {a-b} entry."""
    parts: list[str] = []
    layers = [int(m.group(1)) for p in paths if (m := re.match(r"^model\.layers\.(\d+)$", p))]
    for p in paths:
        if not re.match(r"^model\.layers\.\d+$", p):
            parts.append(p)
        elif int(p.split(".")[2]) == layers[0]:
            parts.append("model.layers.{" + _ranges(layers).replace(", ", ",") + "}")
    return ", ".join(parts)


def dry_run_text(low: Lowering) -> str:
    p = low.plan
    out = [f"MindSpore lowering of {p.model.name}: {strategy_summary(p)}",
           f"devices {p.world_size}, mesh {p.mesh.describe()}; nothing compiled (--dry-run)"]
    if p.strategy.cp > 1:
        out.append(f"context parallel: {cp_algorithm(p)} over cp ({p.strategy.cp} ranks)")
    out += ["", "mindspore.set_auto_parallel_context("]
    out += [f"    {k}={v!r}," for k, v in low.context.items()]
    out += [")", "", f"op shard strategies ({len(low.ops)} ops; in = per-input strategy, out = out_strategy; "
                     "{a-b} = every layer in the range):"]
    out += op_lines(low)
    out += ["", "pipeline_stage of each cell" + (" (pipeline_segment = virtual chunk)"
                                                if p.strategy.pipeline.virtual_stages > 1 else "") + ":"]
    by_stage: "OrderedDict[tuple, list[str]]" = OrderedDict()
    for cell, where in sorted(low.cell_stages.items(), key=lambda kv: kv[1]):
        by_stage.setdefault(where, []).append(cell)
    for (stage, seg), cells in by_stage.items():
        label = f"stage {stage}" + (f" segment {seg}" if p.strategy.pipeline.virtual_stages > 1 else "")
        out.append(f"  {label}: {_cells(cells)}")
    out += ["", "attention: " + ("FlashAttentionScore (BNSD) on Ascend, BatchMatMul + softmax where it has no kernel"
                                 if flash_attention(p) else "BatchMatMul + softmax")]
    out += ["recompute: " + (", ".join(low.recompute_cells + low.recompute_ops) or "none")]
    if p.strategy.pp > 1:
        out.append(f"training cell: nn.PipelineCell(net, micro_size={p.micro_batches})")
    elif p.micro_batches > 1:
        out.append(f"training cell: gradient accumulation over {p.micro_batches} micro-batches")
    out.append("strategy files: <run>/strategy/ckpt_strategy_rank_{rank}.ckpt per rank (ParallelStrategyMap); "
               "with --run-dir, --dry-run writes them")
    out += [f"note: {n}" for n in low.notes]
    return "\n".join(out)
