"""JobConfig: one YAML holding (or referencing) the model, strategy and train sections.

    name: tiny_torch_dp2
    backend: torch
    model: tiny                 # a file in configs/models, a path, or an inline mapping
    strategy: {dp: 2, zero: {stage: 1}}
    train: {global_batch_size: 8, steps: 20}

A string section is a path relative to the YAML file, else a name under configs/<section>s/.
Everything is read with yaml.safe_load; every error names the file and the key path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, spec, to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import ConfigError, MsLlmError
from ms_llm.strategy.ir import ParallelStrategy

CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"
SECTIONS = {"model": ModelConfig, "strategy": ParallelStrategy, "train": TrainConfig}
SECTION_DIRS = {"model": "models", "strategy": "strategies", "train": "train"}


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str = spec("job", "Run name; the default run folder is runs/<name>-<time>.")
    backend: Literal["torch", "mindspore"] = spec("torch", "Default backend for `ms-llm train`.")
    device: str = spec("h100", "Device the cost model plans for (h100, h200, a100, 910b, cpu).")
    model: ModelConfig = field(metadata={"doc": "Model shape."})
    strategy: ParallelStrategy = field(default_factory=ParallelStrategy, metadata={"doc": "Parallel strategy."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training settings."})


def read_text(path: Path) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def parse_yaml(text: str, source: str | Path) -> Any:
    """yaml.safe_load with an error that names the file and line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}:{where} not valid YAML: {getattr(exc, 'problem', exc)}") from None


def read_yaml(path: Path) -> Any:
    return parse_yaml(read_text(path), path)


def find_section_file(section: str, ref: str, base: Path | None) -> Path:
    candidates = []
    if base is not None:
        candidates.append(base / ref)
    folder = CONFIG_ROOT / SECTION_DIRS[section]
    candidates += [Path(ref), folder / ref, folder / f"{ref}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    raise ConfigError(f"{section}: {ref!r} is neither a file nor a name in configs/{SECTION_DIRS[section]} "
                      f"(known: {', '.join(known)})")


def load_section(section: str, value: Any, base: Path | None = None, where: str = "") -> Any:
    """Parse one section given inline (mapping) or by reference (string)."""
    cls = SECTIONS[section]
    if isinstance(value, str):
        path = find_section_file(section, value, base)
        data = read_yaml(path)
        if isinstance(data, dict) and set(data) == {section}:
            data = data[section]
        try:
            return from_dict(cls, data, section)
        except MsLlmError as exc:
            raise type(exc)(f"{path}: {exc}") from None
    try:
        return from_dict(cls, value, section)
    except MsLlmError as exc:
        raise type(exc)(f"{where}{exc}") from None


def job_from_dict(data: Any, base: Path | None = None, where: str = "") -> JobConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}expected a mapping with model / strategy / train sections, got {data!r}")
    if "model" not in data:
        raise ConfigError(f"{where}model: missing; name a file in configs/models or give the sizes inline")
    data = {k: load_section(k, v, base, where) if k in SECTIONS else v for k, v in data.items()}
    try:
        return from_dict(JobConfig, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None


def load_job(path: str | Path) -> JobConfig:
    path = Path(path)
    return job_from_dict(read_yaml(path), path.parent, f"{path}: ")


def job_to_dict(job: JobConfig) -> dict:
    """The YAML mapping load_job reads back into an equal JobConfig."""
    out = {"name": job.name}
    if job.backend != "torch":
        out["backend"] = job.backend
    if job.device != "h100":
        out["device"] = job.device
    out["model"] = to_dict(job.model)
    out["strategy"] = to_dict(job.strategy)
    out["train"] = to_dict(job.train)
    return out


def dump_yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
