"""What every format converter shares: the result type, a mapping reader that remembers which
keys it used (so nothing a source file says is dropped without a warning), and small helpers.

A reader turns one file into a `Converted` (a JobConfig plus warnings); a writer turns a
JobConfig into text plus the IR fields it expressed. convert/__init__.py validates in between
and warns about every non-default IR field a writer did not express.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import SCALAR_NAMES, scalar
from ms_llm.errors import InputError, MsLlmError
from ms_llm.job import JobConfig, job_from_dict, job_name_from

MISSING = object()
DTYPES = ("float32", "bfloat16", "float16")


class ConversionError(InputError):
    """A strategy file that cannot be read or contradicts itself, or a --strict conversion that
    would lose something."""


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """What the command line adds to a source file."""
    world_size: int | None = None        # --world-size: overrides what the source implies
    model: ModelConfig | None = None     # --model: for formats that hold no model shape (DeepSpeed)
    device: str | None = None            # --device


@dataclass
class Converted:
    """A source read into the IR: `job` (model + strategy + train), the world size the source
    implies (None when it says nothing), what could not be carried over, and where each IR field
    came from (for error messages that point into the source)."""
    job: JobConfig
    world_size: int | None
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class Written:
    text: str
    expressed: set[str]                  # IR paths (or prefixes) the text carries
    warnings: list[str] = field(default_factory=list)


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return "one of " + ", ".join(map(repr, kind))
    return {**SCALAR_NAMES, list: "a list", dict: "a mapping"}[kind]


class Fields:
    """Typed, recorded access to a parsed config mapping.

    `get("parallel_config.model_parallel", int, 1, ir="strategy.tp")` returns the value (or the
    default), raises ConversionError naming the file and key on a wrong type, marks the key used
    and remembers that strategy.tp came from it. `unused()` lists every key nobody asked for.
    With `text=True` values are command-line strings and are parsed to the requested type.
    """

    def __init__(self, data: dict, source: str, text: bool = False):
        self.data, self.source, self.text = data, source, text
        self.used: set[str] = set()
        self.sources: dict[str, str] = {}

    def error(self, path: str, reason: str) -> ConversionError:
        return ConversionError(f"{self.source}: {path}: {reason}")

    def _lookup(self, path: str) -> Any:
        node: Any = self.data
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return MISSING
            node = node[key]
        return node

    def has(self, path: str) -> bool:
        return self._lookup(path) is not MISSING

    def peek(self, path: str, default: Any = None) -> Any:
        """The value as parsed, without marking it used (to choose how to read a section)."""
        value = self._lookup(path)
        return default if value is MISSING else value

    def accept_usual(self, usual: dict[str, tuple | None], prefix: str = "") -> None:
        """Mark read the keys whose value is one of their usual ones (None: any value): settings that
        say nothing the IR models. Any other value stays unread, so it is named in a warning."""
        for key, values in usual.items():
            path = prefix + key
            if self.has(path) and (values is None or self.peek(path) in values):
                self.used.add(path)

    def raw(self, path: str, default: Any = None, *, ir: str | None = None) -> Any:
        """The value as parsed, unchecked (for keys that take several types); marks it used."""
        value = self._lookup(path)
        self.used.add(path)
        if value is not MISSING and ir:
            self.sources[ir] = path
        return default if value is MISSING else value

    def get(self, path: str, kind: Any, default: Any = MISSING, *, ir: str | None = None) -> Any:
        value = self._lookup(path)
        self.used.add(path)
        if value is MISSING:
            if default is MISSING:
                raise self.error(path, f"missing; expected {_kind_name(kind)}")
            return default
        value = self._convert(path, value, kind)
        if ir:
            self.sources[ir] = path
        return value

    def _convert(self, path: str, value: Any, kind: Any) -> Any:
        if isinstance(kind, tuple):
            if value in kind:
                return value
            raise self.error(path, f"got {value!r}; expected {_kind_name(kind)}")
        if kind in (list, dict):
            if isinstance(value, kind):
                return value
            raise self.error(path, f"got {value!r}; expected {_kind_name(kind)}")
        try:
            if self.text and isinstance(value, str) and kind is int:
                return int(value)             # command-line values are strings
            return scalar(kind, value)
        except ValueError:
            raise self.error(path, f"got {value!r}; expected {_kind_name(kind)}") from None

    def unused(self) -> list[str]:
        """A warning per key nobody asked for: one per top-level key, one per nested section
        (listing its keys), one per section nobody touched at all."""
        out: list[str] = []

        def touched(path: str) -> bool:
            return any(u == path or u.startswith(path + ".") or path.startswith(u + ".") for u in self.used)

        def shown(value: Any) -> str:
            return "(set)" if value is True and self.text else repr(value)

        def walk(node: dict, prefix: str) -> None:
            leaves = []
            for key, value in node.items():
                path = f"{prefix}{key}"
                if path in self.used or any(path.startswith(u + ".") for u in self.used):
                    continue
                if isinstance(value, dict) and value and not touched(path):
                    out.append(f"{path}: section not modelled by ms_llm ({len(value)} keys); dropped")
                elif isinstance(value, dict) and value:
                    walk(value, path + ".")
                elif prefix:
                    leaves.append(f"{key} = {shown(value)}")
                else:
                    out.append(f"{path} = {shown(value)}: not modelled by ms_llm; dropped")
            if leaves:
                out.append(f"{prefix[:-1]}: {', '.join(leaves)}: not modelled by ms_llm; dropped")
        walk(self.data, "")
        return out


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def covered(path: str, expressed: set[str]) -> bool:
    return any(path == e or path.startswith(e + ".") for e in expressed)


def annotate(problem: str, sources: dict[str, str]) -> str:
    """Point an IR-level problem ("strategy.tp: ...") at the source key it came from."""
    path = problem.split(":", 1)[0].strip()
    for key in sorted(sources, key=len, reverse=True):
        if path == key or path.startswith(key + "."):
            return f"{problem} [source: {sources[key]}]"
    return problem


def num(x: float) -> str:
    """A number as the shortest text that reads back to the same value."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def moe_pattern(model: ModelConfig) -> list[int]:
    """The 0/1 flag per layer (1 = MoE) that Megatron's --moe-layer-freq and MindFormers'
    moe_layer_freq lists take."""
    return [int(model.is_moe_layer(i)) for i in range(model.num_layers)]


def moe_layers(pattern: list[int]) -> dict:
    """model.moe's first_dense_layers / layer_freq / dense_layers for a 0/1 flag per layer: the
    form with the fewest fields off their defaults, then the fewest listed dense layers (a leading
    dense block reads as first_dense_layers, every N-th layer as layer_freq)."""
    moe = {i for i, flag in enumerate(pattern) if flag}
    best = None
    for first in sorted({0, min(moe)}):
        for freq in range(1, len(pattern) + 1):
            regular = {i for i in range(first, len(pattern)) if i % freq == 0}
            if not moe <= regular:
                continue
            dense = sorted(regular - moe)
            key = ((first != 0) + (freq != 1) + len(dense), len(dense), first, freq)
            if best is None or key < best[0]:
                best = (key, {"first_dense_layers": first, "layer_freq": freq, "dense_layers": dense})
    return best[1]


def cp_algorithm(job: JobConfig, target: str, warnings: list[str]) -> str:
    """The context-parallel algorithm a writer names: the job's, or for 'auto' (with cp > 1) the cost
    model's pick on the job's device, said in a warning since the target file has no 'auto'."""
    from ms_llm.strategy.cost import cp_algorithm as pick, shape_of
    from ms_llm.strategy.devices import get_device
    s = job.strategy
    if s.context_parallel.algorithm != "auto" or s.cp == 1:
        return s.context_parallel.algorithm
    chosen = pick(shape_of(job.model, s, job.train), get_device(job.device))
    warnings.append(f"strategy.context_parallel.algorithm = auto: {target} names one; the cost model's pick on "
                    f"{job.device}, {chosen}, is written")
    return chosen


def make_job(fields: Fields, *, name: str, model: ModelConfig | dict, strategy: dict, train: dict,
             device: str = "h100", backend: str = "torch") -> JobConfig:
    """JobConfig from plain sections; a range or type error names the IR field and the source key."""
    data = {"name": job_name_from(name), "device": device, "backend": backend, "model": model, "strategy": strategy,
            "train": train}
    try:
        return job_from_dict(data)
    except MsLlmError as exc:
        raise ConversionError(f"{fields.source}: {annotate(str(exc), fields.sources)}") from None
