"""JobConfig: one YAML holding (or referencing) the model, strategy and train sections.

    name: tiny_torch_dp2
    backend: torch
    model: tiny                 # a file in configs/models, a path, or an inline mapping
    strategy: {dp: 2, zero: {stage: 1}}
    train: {global_batch_size: 8, steps: 20}

A string section is a path relative to the YAML file, else a name under configs/<section>s/.
Everything is read with yaml.SafeLoader, bounded (BoundedLoader: a 600-byte "billion laughs" of
aliases is refused, not expanded); every error names the file and the key path.
Command-line overrides (`--set train.steps=100`, `--model NAME`) are set in the mapping before
it is validated, so a bad one gets the error the same line in the YAML would.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import from_dict, shown, spec, to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import ConfigError, MsLlmError
from ms_llm.strategy.devices import DEVICES, get_device
from ms_llm.strategy.ir import ParallelStrategy

CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"
SECTIONS = {"model": ModelConfig, "strategy": ParallelStrategy, "train": TrainConfig}
SECTION_DIRS = {"model": "models", "strategy": "strategies", "train": "train"}
# A job name is a path component (runs/<name>-<time>, /dev/shm/ms_llm/<name>-...): no separator, no
# '..', nothing a shell or a file system treats specially, and short enough for NAME_MAX (255) with
# the time or the memory tier's suffix added.
JOB_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def job_name_from(text: str) -> str:
    """A valid job name made from `text` (a converted file's stem, a peer's model name): other
    characters become '_', leading dots go, the rest is cut to 128."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")[:128]
    return name or "job"


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str = spec("job", "Run name; the default run folder is runs/<name>-<time>.")
    backend: Literal["torch", "mindspore"] = spec("torch", "Default backend for `ms-llm train`.")
    device: str = spec("h100", "Device the cost model plans for (h100, h200, a100, 910b, cpu).")
    model: ModelConfig = field(metadata={"doc": "Model shape."})
    strategy: ParallelStrategy = field(default_factory=ParallelStrategy, metadata={"doc": "Parallel strategy."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training settings."})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not JOB_NAME.fullmatch(self.name) or self.name.startswith("."):
            raise ConfigError(f"name: got {shown(self.name)}; a job name is 1-128 characters from A-Z a-z 0-9 . _ - "
                              "and does not start with '.' (it names the run folder, runs/<name>-<time>)")
        try:
            get_device(self.device)
        except ConfigError:
            raise ConfigError(f"device: unknown device {shown(self.device)}; known: {', '.join(DEVICES)}") from None


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


MAX_YAML_VALUES = 100_000     # in one document, aliases expanded: a job holds a few hundred
MAX_YAML_DEPTH = 64           # collections and values one inside another: a job nests about 5 deep


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document holding more than MAX_YAML_VALUES values or
    nesting deeper than MAX_YAML_DEPTH once its aliases are expanded, and an alias inside the
    collection it names. An alias composes to the node it names, shared: 12 levels of 9 aliases
    each are a 600-byte file that loads at once and holds 9**12 values, and every walk of it
    (validation, the repr in an error message) then runs out of time or memory. Each aliased
    node is measured once (memoized), so the bound costs a few operations per node."""

    def __init__(self, stream):
        super().__init__(stream)
        self._values = 0
        self._open: list[Optional[str]] = []                # anchors of the collections being composed
        self._measured: dict[int, tuple[int, int]] = {}     # id(node) -> (values, depth), aliases expanded

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise _refused(event, f"an alias refers to the collection that holds it (*{event.anchor})")
            if event.anchor in self.anchors:                # else the composer names the undefined alias
                values, depth = self._measure(self.anchors[event.anchor])
                self._count(values, len(self._open) + depth, event, "its aliases expand to")
            return super().compose_node(parent, index)
        self._count(1, len(self._open) + 1, event, "it holds")
        if not isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            return super().compose_node(parent, index)
        self._open.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()

    def _count(self, values: int, depth: int, event: yaml.Event, what: str) -> None:
        self._values += values
        if self._values > MAX_YAML_VALUES:
            raise _refused(event, f"{what} more than {MAX_YAML_VALUES} values, far past any job (an alias bomb?)")
        if depth > MAX_YAML_DEPTH:
            raise _refused(event, f"nested deeper than {MAX_YAML_DEPTH} levels")

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        """Values and levels under `node`, aliases expanded (its own aliases were bounded when
        composed, so this recursion is at most MAX_YAML_DEPTH deep)."""
        got = self._measured.get(id(node))
        if got is None:
            if isinstance(node, yaml.ScalarNode):
                got = (1, 1)
            else:
                children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
                sizes = [self._measure(child) for child in children]
                got = (1 + sum(v for v, _ in sizes), 1 + max((d for _, d in sizes), default=0))
            self._measured[id(node)] = got
        return got

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer; one of more than 4300 digits (past Python's conversion limit) is refused."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(node.value)} digits",
                                                    node.start_mark) from None


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def _refused(event: yaml.Event, problem: str) -> yaml.YAMLError:
    return yaml.composer.ComposerError(None, None, problem, event.start_mark)


def parse_yaml(text: str, source: str | Path) -> Any:
    """yaml.safe_load (bounded: BoundedLoader) with an error that names the file and line."""
    try:
        return yaml.load(text, Loader=BoundedLoader)          # BoundedLoader is a yaml.SafeLoader
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
    raise ConfigError(f"{section}: {shown(ref)} is neither a file nor a name in configs/{SECTION_DIRS[section]} "
                      f"(known: {', '.join(known)})")


def read_section(section: str, ref: str, base: Path | None) -> tuple[Path, Any]:
    """The file a section reference names, and its mapping (a file may wrap it in `section:`)."""
    path = find_section_file(section, ref, base)
    data = read_yaml(path)
    if isinstance(data, dict) and set(data) == {section}:
        data = data[section]
    return path, data


def load_section(section: str, value: Any, base: Path | None = None, where: str = "") -> Any:
    """Parse one section given inline (mapping) or by reference (string)."""
    cls = SECTIONS[section]
    if isinstance(value, str):
        path, data = read_section(section, value, base)
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
        raise ConfigError(f"{where}expected a mapping with model / strategy / train sections, got {shown(data)}")
    if "model" not in data:
        raise ConfigError(f"{where}model: missing; name a file in configs/models or give the sizes inline")
    data = {k: load_section(k, v, base, where) if k in SECTIONS else v for k, v in data.items()}
    try:
        return from_dict(JobConfig, data, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None


def load_job(path: str | Path, overrides: Sequence[Override] = ()) -> JobConfig:
    """The job in `path` with `overrides` set; errors name the file and the overrides, if any."""
    path = Path(path)
    data = apply_overrides(read_yaml(path), overrides, path.parent)
    where = f"{path} with {flags(overrides)}: " if overrides else f"{path}: "
    return job_from_dict(data, path.parent, where)


@dataclass(frozen=True)
class Override:
    """One command-line change to a job: a dotted key path and the value to set there."""
    path: tuple[str, ...]
    value: Any
    flag: str            # as the user would type it, for messages and the run's config.yaml


def parse_overrides(sets: Sequence[str] = (), model: str | None = None) -> tuple[Override, ...]:
    """`--model NAME` (first, so `--set model.KEY=...` changes that model) and each `--set
    PATH=VALUE`, the value read as YAML: 2 an integer, 2.0 a number, true a bool, [1, 2] a list."""
    out = [Override(("model",), model, f"--model {shlex.quote(model)}")] if model is not None else []
    for text in sets:
        key, eq, value = text.partition("=")
        flag = f"--set {shlex.quote(text)}"
        if not eq:
            raise ConfigError(f"{flag}: no '='; write PATH=VALUE, e.g. --set train.steps=100")
        path = tuple(key.strip().split("."))
        if not all(path):
            raise ConfigError(f"{flag}: {key!r} is not a dotted key path such as strategy.zero.stage")
        out.append(Override(path, parse_yaml(value, flag), flag))
    return tuple(out)


def flags(overrides: Sequence[Override]) -> str:
    """The overrides as a command line gives them, for messages and the run's config.yaml."""
    return " ".join(o.flag for o in overrides)


def apply_overrides(data: Any, overrides: Sequence[Override], base: Path | None) -> Any:
    """A copy of the job mapping with each override set, unchecked: job_from_dict then checks
    it as it checks a file. A section the job gives by reference is read (relative to `base`)
    before a key in it is set; one the command line names is read relative to the working
    directory, as `--model` is everywhere."""
    if not overrides or not isinstance(data, dict):
        return data                  # job_from_dict names what a non-mapping job lacks
    data = copy.deepcopy(data)
    for o in overrides:
        try:
            _set(data, o, base)
        except ConfigError as exc:
            raise ConfigError(f"{o.flag}: {exc}") from None
    return data


def _set(data: dict, o: Override, base: Path | None) -> None:
    """Set one override in `data`; the sections on its path become mappings of their own."""
    node, cls = data, JobConfig
    for depth, key in enumerate(o.path[:-1]):
        path = ".".join(o.path[:depth + 1])
        cls = _section_type(cls, key, path)
        child = node.get(key)
        if depth == 0 and key in SECTIONS and isinstance(child, str):
            child = read_section(key, child, base)[1]
        if child is not None and not isinstance(child, dict) and cls is not None:
            raise ConfigError(f"{path}: got {shown(child)}; expected a mapping of {cls.__name__} fields")
        node[key] = child if isinstance(child, dict) else {}
        node = node[key]
    value = o.value
    if len(o.path) == 1 and o.path[0] in SECTIONS and isinstance(value, str):
        value = read_section(o.path[0], value, None)[1]
    node[o.path[-1]] = copy.deepcopy(value)         # a later override may set a key inside it


def _section_type(cls: type | None, key: str, path: str) -> type | None:
    """The dataclass a key path goes on into; None past an unknown key (from_dict names it with
    the known keys, as for a file)."""
    hint = typing.get_type_hints(cls).get(key) if cls is not None else None
    if hint is None:
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    section = next((t for t in options if dataclasses.is_dataclass(t)), None)
    if section is None:
        raise ConfigError(f"{path}: a value, not a section with keys; set it whole: --set {path}=VALUE")
    return section


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
