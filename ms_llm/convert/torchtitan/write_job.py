"""IR -> a torchtitan 0.3 job: a registered config (`--module llama3 --config llama3_8b`) plus
the command-line overrides ConfigManager parses (torchtitan_args.py names their syntax), as a
torchrun launch script; torchtitan.read reads it back. Every value the IR holds is written, so
the registry entry decides only what ms_llm does not model.
"""
from __future__ import annotations

import shlex

from ms_llm.convert.common import Written
from ms_llm.convert.torchtitan import flavors
from ms_llm.convert.torchtitan.args import AC, OPTIMIZER
from ms_llm.convert.torchtitan.read import fqn_parts
from ms_llm.convert.torchtitan.write_toml import SHAPE_FIELDS, job_sections
from ms_llm.job import CONFIG_ROOT, JobConfig, load_section

# Registered configs whose model ms_llm ships under the same name in configs/models.
CONFIGS = {"llama3_8b": "llama3", "llama3_70b": "llama3", "qwen3_32b": "qwen3"}


def write(job: JobConfig, world_size: int) -> Written:
    sections, expressed, warnings = job_sections(job)
    module, config = _config(job, warnings)
    algorithm = job.strategy.context_parallel.algorithm
    if job.strategy.cp > 1 and algorithm != "allgather":
        warnings.append(f"strategy.context_parallel.algorithm = {algorithm}: torchtitan 0.3 has no rotate method; its "
                        "context parallel all-gathers K/V (PyTorch's default allgather rotation), which is what runs")
    args = [f"--module {module}", f"--config {config}"]
    for section, values in sections.items():
        if section in ("job", "model", "optimizer", AC):
            continue
        for key, value in values.items():
            if key == "module_fqns_per_model_part":
                args += _split_flags(job, warnings)
                continue
            args.append(_flag("debug.seed" if key == "seed" else f"{section}.{key}", value))
    o = sections["optimizer"]
    args += [f"--{OPTIMIZER}.lr {o['lr']!r}", f"--{OPTIMIZER}.betas {o['beta1']!r} {o['beta2']!r}",
             f"--{OPTIMIZER}.eps {o['eps']!r}", f"--{OPTIMIZER}.weight_decay {o['weight_decay']!r}"]
    if job.strategy.pp > 1 or job.strategy.ep > 1:
        # 0.3 refuses CUDA graphs with pipeline parallel, and with its all-to-all expert dispatcher
        args.append("--training.disable_cuda_graphs")
    ac = sections[AC]
    mode = ac["mode"]
    if mode == "selective" and ac.get("selective_ac_option") != "op":
        warnings.append(f"strategy.recompute.num_layers = {job.strategy.recompute.num_layers}: torchtitan 0.3 "
                        "recomputes every layer (full) or op by op (selective); full written")
        mode = "full"
    args.append(f"{AC}:{mode}")                 # tyro subcommand: after every option
    lines = ["#!/bin/bash", f"# {job.name}: {job.model.name} on {world_size} GPUs; torchtitan 0.3 job written by "
             "ms-llm convert-strategy.", "# Run from the torchtitan repository root.", "",
             f"NGPU=${{NGPU:-{world_size}}}", "", "torchrun --nproc_per_node=$NGPU -m torchtitan.train \\"]
    lines += [f"    {a} \\" for a in args[:-1]] + [f"    {args[-1]}"]
    return Written("\n".join(lines) + "\n", expressed, warnings)


def _config(job: JobConfig, warnings: list[str]) -> tuple[str, str]:
    m = job.model
    known = flavors.match(m, warnings) if m.moe is not None else None
    if known is not None:
        return known
    for config, module in CONFIGS.items():
        if (CONFIG_ROOT / "models" / f"{config}.yaml").is_file():
            known = load_section("model", config)
            if all(getattr(known, k) == getattr(m, k) for k in SHAPE_FIELDS):
                return module, config
    module = "deepseek_v3" if m.mla is not None else "qwen3" if m.qk_norm else "llama3"
    warnings.append(f"model: no registered torchtitan 0.3 config has this shape; --config {m.name} written (register "
                    f"it in torchtitan/models/{module}/config_registry.py; ms_llm reads it back from configs/models "
                    "or --model)")
    return module, m.name


def _split_flags(job: JobConfig, warnings: list[str]) -> list[str]:
    """A layer split as torchtitan's generate_llm_fqn_per_model_part makes it: the embedding and the
    output weigh 0 or 1 layers (first/last_stage_less_layers), the part count follows
    layers_per_stage. Module lists do not fit on its command line."""
    m, s = job.model, job.strategy
    chunks = s.pp * s.pipeline.virtual_stages
    split = list(s.pipeline.layer_split or [m.num_layers // chunks] * chunks)
    for first, last in ((1, 1), (0, 0), (1, 0), (0, 1)):
        total = m.num_layers + first + last
        per = -(-total // chunks)
        if -(-total // per) == chunks and fqn_parts(chunks, m.num_layers, first, last) == split:
            par = "--parallelism.pipeline_parallel"
            return [f"{par}_first_stage_less_layers {first}", f"{par}_last_stage_less_layers {last}",
                    f"{par}_layers_per_stage {per}"]
    warnings.append(f"strategy.pipeline.layer_split = {split}: torchtitan 0.3 takes no module lists on its command "
                    "line and splits otherwise; its own split is written")
    return []


def _flag(path: str, value: object) -> str:
    if isinstance(value, bool):
        section, _, key = path.rpartition(".")
        return f"--{path}" if value else f"--{section}.no-{key}"
    return f"--{path} {shlex.quote(str(value))}"
