"""Typed dataclass <-> plain dict conversion with errors that name the full key path.

Config sections are frozen dataclasses whose fields carry their own documentation and
allowed range (see `spec`): every number field has both bounds, so a value that would
overflow a size computed from it (1e308 layers) stops here, and no number is NaN or infinite.
`from_dict` walks a parsed YAML mapping into them and raises
ConfigError("strategy.pipeline.micro_batches: ...") on the first bad value; `to_dict` writes back
only what differs from the defaults, so YAML -> IR -> YAML is the identity.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ms_llm.errors import ConfigError


def spec(default: Any = dataclasses.MISSING, doc: str = "", *, ge: float | None = None,
         le: float | None = None, choices: tuple | None = None, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with a docstring and a range that `from_dict` enforces."""
    meta = {"doc": doc, "ge": ge, "le": le, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 6
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 40


def shown(value: Any) -> str:
    """repr(value) for an error message: at most 100 characters, and reprlib looks at 6 items of
    3 levels only, however large or deep the value (a YAML alias can make it 34 MB long)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def scalar(kind: type, value: Any) -> Any:
    """`value` read as a YAML scalar of `kind` (a key of SCALAR_NAMES), or ValueError. An
    integral float is an integer; a string that parses as a float is a number, since YAML 1.1
    reads an exponent without a sign (1e-4) as a string."""
    if kind is float and isinstance(value, str):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: numeric and isinstance(value, int), float: numeric,
          str: isinstance(value, str)}[kind]
    if not ok:
        raise ValueError(f"got {shown(value)}; expected {SCALAR_NAMES[kind]}")
    return float(value) if kind is float else value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(get_args(tp)):
            return None
        if len(options) == 1:
            return _convert(options[0], value, path)
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: got {shown(value)}; allowed: {_type_name(tp)}")
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in get_args(tp)):
            return value
        raise ConfigError(f"{path}: got {shown(value)}; allowed: {_type_name(tp)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: got {shown(value)}; expected a list of {_type_name(get_args(tp)[0])}")
        item = get_args(tp)[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: got {shown(value)}; expected null")
    if tp in SCALAR_NAMES:
        try:
            return scalar(tp, value)
        except ValueError:
            raise ConfigError(f"{path}: got {shown(value)}; expected {SCALAR_NAMES[tp]}") from None
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _check_range(f: dataclasses.Field, value: Any, path: str) -> None:
    meta = f.metadata
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        values = value if isinstance(value, tuple) else ()
        for i, v in enumerate(values):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _check_number(meta, v, f"{path}[{i}]")
    else:
        _check_number(meta, value, path)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{path}: got {shown(value)}; allowed: {', '.join(map(repr, meta['choices']))}")


def _check_number(meta: dict, value: float, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: got {shown(value)}; expected a finite number")
    ge, le = meta.get("ge"), meta.get("le")
    text = repr(value) if len(repr(value)) <= 24 else f"{value:.3g}"
    if ge is not None and value < ge:
        raise ConfigError(f"{path}: got {text}; must be >= {ge}")
    if le is not None and value > le:
        raise ConfigError(f"{path}: got {text}; must be <= {le}")


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping; every error names the key path."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: got {shown(data)}; expected a mapping of {cls.__name__} fields")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    moved = [k for k in data if k in getattr(cls, "MOVED_KEYS", {})]     # keys older configs used
    if moved:
        key = moved[0]
        raise ConfigError(f"{_join(path, str(key))}: this key moved to {_join(path, cls.MOVED_KEYS[key])}; "
                          "write it there")
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"{_join(path, str(key))}: unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        key_path = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key_path}: missing; expected {_type_name(hints[name])}")
            continue
        value = _convert(hints[name], data[name], key_path)
        _check_range(f, value, key_path)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path and not str(exc).startswith(path) else str(exc)) from None


def to_dict(obj: Any, *, full: bool = False) -> dict:
    """The mapping `from_dict` reads back; only non-default fields unless `full`."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sub = to_dict(value, full=full)
            if sub or full or f.default is None:         # an optional section, present with its defaults
                out[f.name] = sub
            continue
        if not full:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            if value == default:
                continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> documentation with its allowed range, for `--help` style listings."""
    return {f.name: f.metadata.get("doc", "") + _range_text(f.metadata) for f in dataclasses.fields(cls)}


def _range_text(meta: Any) -> str:
    ge, le = meta.get("ge"), meta.get("le")
    return f" [{ge} .. {le}]" if ge is not None or le is not None else ""
