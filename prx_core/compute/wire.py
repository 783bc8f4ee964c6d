"""JSON for stage arguments and reports that cross a process boundary (a Ray job's Pipes messages).

Stage reports are `prx_core` dataclasses of numbers, strings, lists and dicts. They travel as
JSON, never as pickles: a Pipes message is a line of the job's log, and unpickling a log line
would run whatever it names. Decoding rebuilds only dataclasses defined in `prx_core`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

CLASS, TUPLE, SET = "__prx_class__", "__prx_tuple__", "__prx_set__"


class WireError(ValueError):
    """A value that cannot cross as JSON, or a payload naming a class outside prx_core."""


def encode(value: Any) -> Any:
    """A JSON-able form of `value` that `decode` turns back into an equal value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {CLASS: f"{cls.__module__}:{cls.__qualname__}", **fields}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise WireError(f"dict keys must be strings to cross as JSON: {sorted(map(repr, value))[:5]}")
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {TUPLE: [encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {SET: [encode(v) for v in sorted(value, key=repr)]}
    if hasattr(value, "item") and callable(value.item):  # numpy / pyarrow scalars
        return encode(value.item())
    raise WireError(f"cannot send a {type(value).__name__} as JSON: {value!r:.100}")


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if TUPLE in data:
        return tuple(decode(v) for v in data[TUPLE])
    if SET in data:
        return {decode(v) for v in data[SET]}
    if CLASS in data:
        cls = _prx_dataclass(data[CLASS])
        return cls(**{k: decode(v) for k, v in data.items() if k != CLASS})
    return {k: decode(v) for k, v in data.items()}


def _prx_dataclass(name: Any) -> type:
    module, _, qualname = str(name).partition(":")
    if module != "prx_core" and not module.startswith("prx_core."):
        raise WireError(f"refusing to build {name!r}: only prx_core dataclasses cross the wire")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
        raise WireError(f"{name!r} is not a prx_core dataclass")
    return target
