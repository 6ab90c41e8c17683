"""Convert parallel-strategy configs between Megatron-LM, DeepSpeed, MindFormers, torchtitan and
ms_llm, always through the IR:

    source file --read--> JobConfig (ParallelStrategy + ModelConfig + TrainConfig) --validate-->
    canonical JobConfig --write--> target text

Every reader reports what the source said that the IR does not model; every writer reports what
the target cannot express (and the non-default IR fields it did not write are added here), so
nothing is dropped silently. `strict=True` turns those warnings into a ConversionError.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import ModuleType

from ms_llm.config.schema import to_dict
from ms_llm.convert import msllm
from ms_llm.convert.deepspeed import json_config as deepspeed
from ms_llm.convert.megatron import read as megatron, write as megatron_script
from ms_llm.convert.mindformers import pynative as mindformers_pynative, read as mindformers
from ms_llm.convert.mindformers import write as mindformers_yaml, write2 as mindformers2_yaml
from ms_llm.convert.torchtitan import args as torchtitan_args, read as torchtitan
from ms_llm.convert.torchtitan import write_job as torchtitan_job, write_toml as torchtitan_toml
from ms_llm.job import parse_yaml, read_text
from ms_llm.convert.common import (ConversionError, Converted, ReadOptions, Written, annotate, covered,
                                   flatten)
from ms_llm.errors import MsLlmError, StrategyError
from ms_llm.strategy.validate import validate

# "mindformers" reads every MindFormers layout and writes r1.x; "mindformers2" writes 2.x (use_legacy: False).
# "torchtitan" reads 0.3 jobs and v0.2.x TOML and writes 0.3 jobs; "torchtitan_toml" writes v0.2.x TOML.
READERS: dict[str, ModuleType] = {"ms_llm": msllm, "megatron": megatron, "deepspeed": deepspeed,
                                  "mindformers": mindformers, "mindformers2": mindformers, "torchtitan": torchtitan,
                                  "torchtitan_toml": torchtitan}
WRITERS: dict[str, ModuleType] = {**READERS, "megatron": megatron_script, "mindformers": mindformers_yaml,
                                  "mindformers2": mindformers2_yaml, "torchtitan": torchtitan_job,
                                  "torchtitan_toml": torchtitan_toml}
FORMATS = tuple(READERS)
SUFFIXES = {".json": "deepspeed", ".toml": "torchtitan", ".sh": "megatron", ".bash": "megatron",
            ".args": "megatron"}
OUTPUT_SUFFIXES = {**SUFFIXES, ".toml": "torchtitan_toml"}
MINDFORMERS_KEYS = ("parallel_config", "runner_config", "recompute_config", "use_parallel", "runner_wrapper")

__all__ = ["FORMATS", "ConversionError", "Converted", "ReadOptions", "Written", "detect_format", "read",
           "load", "dump", "convert", "format_for_output", "from_job"]


def detect_format(text: str, source: str) -> str:
    """The format of a file from its name, else its content; an error when it is ambiguous."""
    suffix = Path(source).suffix.lower()
    if suffix in ("", ".sh", ".bash", ".args") and torchtitan_args.is_job(text):
        return "torchtitan"
    if suffix in SUFFIXES:
        return SUFFIXES[suffix]
    stripped = text.lstrip()
    if suffix in (".yaml", ".yml") or not suffix:
        if stripped.startswith("{") and not suffix:
            return "deepspeed"
        if stripped.startswith("#!") or stripped.startswith("--"):
            return "megatron"
        try:
            data = parse_yaml(text, source)
        except MsLlmError:
            data = None
        if isinstance(data, dict):
            if any(k in data for k in MINDFORMERS_KEYS) or isinstance(data.get("model"), dict) and \
                    "model_config" in data["model"] or mindformers_pynative.is_pynative(data):
                return "mindformers"
            if "model" in data and ("strategy" in data or "train" in data):
                return "ms_llm"
    raise ConversionError(f"{source}: cannot tell which format this is (by its suffix or content); "
                          f"pass --from {{{','.join(FORMATS)}}}")


def format_for_output(path: str) -> str | None:
    return OUTPUT_SUFFIXES.get(Path(path).suffix.lower())


def read(text: str, source: str, fmt: str | None = None, options: ReadOptions = ReadOptions()) -> Converted:
    """Read `text` (named `source` in messages) as `fmt`, validate it and put it in canonical form."""
    fmt = fmt or detect_format(text, source)
    if fmt not in READERS:
        raise ConversionError(f"--from: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    conv = READERS[fmt].read(text, source, options)
    if options.world_size:
        conv.world_size = options.world_size
    if options.device:
        conv.job = dataclasses.replace(conv.job, device=options.device)
    return _canonical(conv, source, fmt)


def load(path: str | Path, fmt: str | None = None, options: ReadOptions = ReadOptions()) -> Converted:
    """Read a file ('-' reads standard input)."""
    text = sys.stdin.read() if str(path) == "-" else read_text(Path(path))
    return read(text, str(path), fmt, options)


def from_job(job, world_size: int | None, source: str = "job") -> Converted:
    """A JobConfig built in code (e.g. by the search), validated and canonical, ready for dump()."""
    return _canonical(Converted(job, world_size), source, "ms_llm")


def _canonical(conv: Converted, source: str, fmt: str) -> Converted:
    """Validate, then write the strategy the one way ms_llm writes it: dp explicit, shard_size
    -1 for "all of dp", etp -1 for "= tp", micro-batches and an even layer split left to be derived."""
    job = conv.job
    try:
        s = validate(job.model, job.strategy, job.train, conv.world_size)
    except StrategyError as exc:
        problems = "\n".join(f"  - {annotate(p, conv.sources)}" for p in exc.problems)
        raise ConversionError(f"{source} (read as {fmt}): the strategy does not validate:\n{problems}") from None
    pipe, zero = s.pipeline, s.zero
    chunks = s.pp * pipe.virtual_stages
    if pipe.layer_split is not None and len(set(pipe.layer_split)) == 1 and len(pipe.layer_split) == chunks:
        pipe = dataclasses.replace(pipe, layer_split=None)
    pipe = dataclasses.replace(pipe, micro_batches=-1)
    if zero.shard_size == s.dp:
        zero = dataclasses.replace(zero, shard_size=-1)
    etp = -1 if s.etp == s.tp else s.etp
    conv.job = dataclasses.replace(job, strategy=dataclasses.replace(s, pipeline=pipe, zero=zero, etp=etp))
    conv.world_size = s.world_size()
    return conv


def dump(conv: Converted, fmt: str) -> Written:
    """Write a canonical Converted as `fmt`, with a warning for every non-default IR field lost."""
    if fmt not in WRITERS:
        raise ConversionError(f"--to: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    out = WRITERS[fmt].write(conv.job, conv.world_size)
    job = conv.job
    values = flatten({"model": to_dict(job.model), "strategy": to_dict(job.strategy), "train": to_dict(job.train)})
    for path, value in values.items():
        if not covered(path, out.expressed):
            out.warnings.append(f"{path} = {value!r}: {fmt} has no setting for it; dropped")
    return out


def convert(path: str | Path, to: str, fmt: str | None = None, options: ReadOptions = ReadOptions(),
            strict: bool = False) -> tuple[str, list[str]]:
    """Source file -> target text and every warning (read side first)."""
    conv = load(path, fmt, options)
    out = dump(conv, to)
    warnings = [f"read: {w}" for w in conv.warnings] + [f"write: {w}" for w in out.warnings]
    if strict and warnings:
        raise ConversionError(f"{path}: --strict and {len(warnings)} thing(s) would not carry over:\n"
                              + "\n".join(f"  - {w}" for w in warnings))
    return out.text, warnings
