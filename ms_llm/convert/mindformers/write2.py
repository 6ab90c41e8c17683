"""IR -> a MindFormers 2.x pretrain YAML (use_legacy: False, Hugging Face model keys); see
mindformers_yaml.py, which writes both layouts."""
from __future__ import annotations

from ms_llm.convert.common import Written
from ms_llm.convert.mindformers import write as mindformers_yaml
from ms_llm.job import JobConfig


def write(job: JobConfig, world_size: int) -> Written:
    return mindformers_yaml.write(job, world_size, mcore=True)
