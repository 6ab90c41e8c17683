"""ms_llm's own job YAML <-> IR: the identity, through config.job's loader and dumper."""
from __future__ import annotations

from pathlib import Path

from ms_llm.convert.common import Converted, ReadOptions, Written
from ms_llm.job import JobConfig, dump_yaml, job_from_dict, job_to_dict, parse_yaml


def read(text: str, source: str, options: ReadOptions) -> Converted:
    job = job_from_dict(parse_yaml(text, source), Path(source).parent, f"{source}: ")
    world = job.strategy.world_size() if job.strategy.dp > 0 else None
    return Converted(job, options.world_size or world)


def write(job: JobConfig, world_size: int) -> Written:
    header = f"# {job.name}: {job.model.name} on {world_size} devices; ms_llm job (ms-llm plan / train)\n"
    return Written(header + dump_yaml(job_to_dict(job)), {"model", "strategy", "train"})
