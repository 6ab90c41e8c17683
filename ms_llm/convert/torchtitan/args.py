"""A torchtitan 0.3 job's command line -> the v0.2.x sections torchtitan.read reads.

torchtitan 0.3 reads no job file: a job is a registered config (`--module llama3 --config
llama3_8b`, a function in torchtitan/models/<module>/config_registry.py) plus overrides that its
ConfigManager parses with tyro: `--section.field value` (dashes or underscores), `--section.flag`
/ `--section.no-flag` for booleans, the optimizer's settings under
`--optimizer.param_groups.0.optimizer_kwargs.*`, and activation checkpointing as a subcommand
(`activation_checkpoint:full`). A value the command line leaves out is read with Trainer.Config's
default, and a note names the essential ones (the registry entry's own values are not known
offline). torchtitan_job.py writes such jobs.
"""
from __future__ import annotations

import re
import shlex

from ms_llm.convert.common import ConversionError
from ms_llm.convert.megatron.read import world_from_launcher
from ms_llm.convert.shell import launch_command

OPTIMIZER = "optimizer.param_groups.0.optimizer_kwargs"
AC = "activation_checkpoint"
ESSENTIAL = ("training.local_batch_size", "training.seq_len", "training.steps", "optimizer.lr",
             "lr_scheduler.warmup_steps", "parallelism.data_parallel_shard_degree")


def is_job(text: str) -> bool:
    """A 0.3 job names its registered config on the command line."""
    return re.search(r"(^|\s)--(module|config)[\s=]", text) is not None


def sections(text: str, source: str) -> tuple[dict, list[str], int | None]:
    """A 0.3 job (launch script or argument list) as the v0.2.x sections torchtitan.read reads,
    notes, and the world size its torchrun launcher gives (None: unknown)."""
    code = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    world = None
    if code and code[0].startswith("--"):
        words, notes = shlex.split(text, comments=True), []
    else:
        launch = launch_command(text, source)
        words, notes = launch.args, list(launch.notes)
        world = world_from_launcher(launch.launcher, source, notes)
    data: dict = {}
    i = 0
    while i < len(words):
        word, eq, value = words[i].partition("=") if words[i].startswith("--") else (words[i], "", "")
        values = [value] if eq else []
        while i + 1 < len(words) and not words[i + 1].startswith(("--", "activation_checkpoint:",
                                                                   "activation-checkpoint:")):
            i += 1
            values.append(words[i])
        i += 1
        if word.startswith(("activation_checkpoint:", "activation-checkpoint:")):
            mode = word.split(":", 1)[1].replace("-", "_")
            _put(data, AC, {"mode": mode, **({"selective_ac_option": "op"} if mode == "selective" else {})})
            continue
        if not word.startswith("--"):
            raise ConversionError(f"{source}: {word!r}: expected --section.field or {AC}:MODE")
        path = word[2:].replace("-", "_")
        section, _, key = path.rpartition(".")
        if not values:                            # a boolean flag: --x.enable / --x.no-enable
            _put(data, f"{section}.{key[3:]}" if key.startswith("no_") else path, not key.startswith("no_"))
        else:
            _put(data, path, values[0] if len(values) == 1 else values)
    module, config = data.pop("module", None), data.pop("config", None)
    if module is None or config is None:
        raise ConversionError(f"{source}: a torchtitan 0.3 job needs --module and --config")
    data["model"] = {"name": module, "flavor": config}
    optimizer = data.get("optimizer", {}).pop("param_groups", {}).get("0", {}).get("optimizer_kwargs", {})
    betas = optimizer.pop("betas", None)
    if betas is not None:
        if not isinstance(betas, list) or len(betas) != 2:
            raise ConversionError(f"{source}: --{OPTIMIZER}.betas: got {betas!r}; expected two numbers")
        optimizer.update(beta1=betas[0], beta2=betas[1])
    data.setdefault("optimizer", {}).update(optimizer)
    missing = [p for p in ESSENTIAL if p.split(".")[1] not in data.get(p.split(".")[0], {})]
    if missing:
        notes.append(f"{', '.join(missing)}: not on the command line; read with Trainer.Config's defaults (the "
                     f"{config} registry entry may set others)")
    return data, notes, world


def _put(data: dict, path: str, value: object) -> None:
    *parents, key = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[key] = value
