"""Reading a DeepSpeed config file the way DeepSpeed does: hjson, so comments and trailing commas load.

DeepSpeed 0.19.8 (``deepspeed.runtime.config.DeepSpeedConfig``) reads a path with
``hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)`` and a string that is not a path
as base64-encoded hjson. Here the same inputs load, and every failure names the file and, where there is
one, the key: a duplicate key, a NaN or Infinity value (DeepSpeed's pydantic models refuse them), a file
that is binary or not UTF-8.

hjson is imported only to read text that is not strict JSON (a GPU machine with no network has
torch but often no hjson): a dict or a strict-JSON file never needs it, and without it an hjson-only file
fails with a ConfigError that names the file and ``pip install hjson``.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re

from zero_offload.config.schema import ConfigError

__all__ = ["read_config_file", "decode_config_string", "check_finite", "raw_config"]

_NON_FINITE = re.compile(r'"?([A-Za-z_][\w.]*)"?\s*:\s*([+-]?(?:NaN|Infinity))\b')


class _NonFinite(float):
    """A NaN/Infinity literal, remembered so the key that holds it can be named."""


def _no_duplicates(source: str):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"config {source}: duplicate key '{key}' (DeepSpeed refuses duplicate keys)")
            seen[key] = value
        return seen
    return hook


# Keys where +Infinity means "never": accelerate writes steps_per_print = inf into every DeepSpeed config it fills.
INFINITY_MEANS_NEVER = {"steps_per_print"}


def check_finite(data, path: str = "") -> None:
    """Raise ConfigError naming the first key whose value is NaN or +-Infinity (at any depth), except
    +Infinity under a key of `INFINITY_MEANS_NEVER`."""
    if path in INFINITY_MEANS_NEVER and data == math.inf:
        return
    if isinstance(data, dict):
        for k, v in data.items():
            check_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            check_finite(v, f"{path}[{i}]")
    elif isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(f"config key '{path or '<root>'}': got {data!r}; NaN and Infinity are not allowed")


def _hjson(source: str, why: json.JSONDecodeError):
    """The hjson module, imported on first need (see the module docstring).

    Raises:
        ConfigError: hjson is not installed; names ``source``, where strict JSON failed (``why``) and the
            package to install.
    """
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config {source} is not strict JSON ({why}); reading it as hjson (comments, trailing "
                          f"commas), as DeepSpeed does, needs the hjson package, which is not installed: "
                          f"pip install hjson, or write the config as strict JSON") from None
    return hjson


def _parse(text: str, source: str) -> dict:
    hook = _no_duplicates(source)
    try:
        # Plain JSON first: it reads NaN/Infinity, so the key holding one can be named below.
        data = json.loads(text, object_pairs_hook=hook, parse_constant=_NonFinite)
    except json.JSONDecodeError as not_json:
        match = _NON_FINITE.search(text)
        if match:
            raise ConfigError(f"config {source}: key '{match.group(1)}' = {match.group(2)}; NaN and Infinity "
                              f"are not allowed") from None
        hjson = _hjson(source, not_json)
        try:
            data = hjson.loads(text, object_pairs_hook=hook)
        except hjson.HjsonDecodeError as e:
            raise ConfigError(f"config {source} is not valid JSON or hjson: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {source} must hold a JSON object at the top level, got {type(data).__name__}")
    check_finite(data)
    return data


def read_config_file(path: str | os.PathLike) -> dict:
    """The config in file ``path`` as a dict (JSON or hjson, as DeepSpeed reads it).

    Raises:
        ConfigError: the file cannot be read, is binary or not UTF-8, is not JSON/hjson, holds a duplicate
            key, NaN or Infinity; the message names the file (and the key where there is one).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from e
    if b"\x00" in raw:
        raise ConfigError(f"config file '{path}' is a binary file, not a JSON/hjson config")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}): not a JSON/hjson "
                          f"config") from None
    return _parse(text, f"file '{path}'")


def decode_config_string(text: str) -> dict | None:
    """A base64-encoded hjson config (DeepSpeed accepts one in place of a path), or None if it is not one."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode()).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not decoded.lstrip().startswith("{"):
        return None
    return _parse(decoded, "(base64 string)")


def raw_config(source: str | os.PathLike) -> dict:
    """The keys a config path (or base64 string, as `zero_offload.Config.load` takes them) sets, as written, for a
    caller that tells set keys from defaults (the planner keeps what the user set).

    Raises:
        ConfigError: as `read_config_file`.
    """
    if isinstance(source, str) and not os.path.exists(source):
        decoded = decode_config_string(source)
        if decoded is not None:
            return decoded
    return read_config_file(source)
