"""Building typed config dataclasses from DeepSpeed-style JSON, with errors that name the key at fault.

Each dataclass field is declared with `option(default, help, ...)`; its help text documents the field where
it is declared and doubles as the text shown by ``--help``. `from_dict` checks every key and value.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
import warnings
from typing import Any, Literal, get_args, get_origin

__all__ = ["ConfigError", "option", "from_dict", "to_dict"]


class ConfigError(ValueError):
    """A config key, value or combination that is not allowed; the message names the key path at fault."""


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices=None, min=None, max=None,
           min_exclusive=False, factory=None, not_implemented: dict | None = None):
    """Declare a config field: its default, its documentation and the checks its value must pass.

    ``not_implemented`` maps values that are valid DeepSpeed settings but not built yet to the reason,
    so they fail loudly instead of being ignored.
    """
    meta = {"help": help, "choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive,
            "not_implemented": not_implemented or {}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return "a list of " + ", ".join(_type_name(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number",
            str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp, path: str):
    """Return `value` as type `tp`, or raise ConfigError naming `path`, the value and what is allowed."""
    origin = get_origin(tp)
    bad = ConfigError(f"config key '{path}': got {value!r}, expected {_type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        alts = [a for a in get_args(tp) if value is None or a is not type(None)]
        if len(alts) == 1:  # Optional[X] with a value: X's own error is the precise one
            return _convert(value, alts[0], path)
        for alt in alts:
            try:
                return _convert(value, alt, path)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        allowed = get_args(tp)
        if isinstance(value, str):
            for a in allowed:  # DeepSpeed compares optimizer and device names case-insensitively
                if isinstance(a, str) and a.lower() == value.lower():
                    return a
        if value in allowed and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{path}': got {value!r}, allowed: {', '.join(map(repr, allowed))}")
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, path)
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        # JSON writes 5e8 as a float; accept integral floats as DeepSpeed does for bucket sizes.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise bad
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp is Any:
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {path}")


def _check_range(value, meta, path):
    lo, hi = meta.get("min"), meta.get("max")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
            op = ">" if meta.get("min_exclusive") else ">="
            raise ConfigError(f"config key '{path}': got {value!r}, must be {op} {lo}")
        if hi is not None and value > hi:
            raise ConfigError(f"config key '{path}': got {value!r}, must be <= {hi}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"config key '{path}': got {value!r}, allowed: {', '.join(map(repr, choices))}")
    reason = meta.get("not_implemented", {}).get(value) if isinstance(value, (int, str, bool)) else None
    if reason:
        raise ConfigError(f"config key '{path}': {value!r} is accepted by DeepSpeed but not implemented "
                          f"in zero-offload yet ({reason})")


@functools.cache
def _type_hints(cls) -> dict:
    """The dataclass's resolved annotations, once per class (resolving them compiles each string: the planner
    reads thousands of configs)."""
    return typing.get_type_hints(cls)


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass `cls` from `data`, checking keys, types, ranges and not-yet-implemented values.

    A class attribute ``IGNORED`` maps DeepSpeed keys that have no effect in zero-offload to the reason;
    they are accepted with one warning each.

    Raises:
        ConfigError: an unknown key (naming the closest valid key), a wrong type or value.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{path or '<root>'}': expected an object, got {data!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    ignored = getattr(cls, "IGNORED", {})
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else key
        if key in ignored:
            warnings.warn(f"config key '{key_path}' has no effect in zero-offload ({ignored[key]}); ignored",
                          stacklevel=3)
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields) + list(ignored), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key '{key_path}'{hint}")
        converted = _convert(value, hints[key], key_path)
        _check_range(converted, fields[key].metadata, key_path)
        kwargs[key] = converted
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def to_dict(obj) -> dict:
    """The config as plain JSON-ready data (tuples become lists)."""
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(obj))
