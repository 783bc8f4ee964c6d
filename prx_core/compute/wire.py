"""JSON for stage arguments and reports that cross a process boundary (a Ray job's Pipes messages).

Stage reports are `prx_core` dataclasses of numbers, strings, lists and dicts. They travel as
JSON, never as pickles: a Pipes message is a line of the job's log, and unpickling a log line
would run whatever it names. Decoding builds only classes registered for the wire (`register`:
each stage module lists what its stage takes and reports as its `WIRE_TYPES`, and
`prx_core.stages.stage` what every stage carries), nests at most `MAX_DEPTH` levels, and a report is
accepted only when it is the one message signed with the run's key (`sign_report` /
`open_report`: HMAC-SHA256 over the stage and the payload) and of the type the stage returns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Iterable
from typing import Any, TypeVar

CLASS, TUPLE, SET = "__prx_class__", "__prx_tuple__", "__prx_set__"
REPORT, MAC = "prx_stage_report", "prx_report_mac"
MAX_DEPTH = 64  # stage reports nest a handful of levels; a 900-deep list is an attack, not a report

T = TypeVar("T", bound=type)
_REGISTRY: dict[str, type] = {}
_MOVED: dict[str, type] = {}  # former names of registered classes, decoded only


class WireError(ValueError):
    """A value that cannot cross as JSON, a class not registered for the wire, a payload nested too
    deep, or a report that is forged, repeated or of the wrong type."""


def register(cls: T) -> T:
    """Allow dataclass `cls` on the wire (a decorator, or through `register_all`)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"only dataclasses cross the wire, not {cls!r}")
    _REGISTRY[wire_name(cls)] = cls
    return cls


def register_all(*classes: type) -> tuple[type, ...]:
    """Allow each of `classes` on the wire: a stage module's one reviewed list (its `WIRE_TYPES`)."""
    for cls in classes:
        register(cls)
    return classes


def register_moved(old_name: str, cls: type) -> None:
    """Decode `old_name` (`module:qualname` before `cls` moved) as `cls`: a report recorded before
    the move (`prx_core.stages.unchanged`) still stands. Encoding always writes the new name."""
    if _REGISTRY.get(wire_name(cls)) is not cls:
        raise TypeError(f"register {wire_name(cls)} before its former name {old_name}")
    _MOVED[old_name] = cls


def register_moved_from(old_module: str, *classes: type) -> None:
    """Decode `old_module:<qualname>` as each of `classes`: what a module that became one of a
    package's modules (a stage's module became its package's `stage`) registered under its former
    path, so a report recorded before still stands."""
    for cls in classes:
        register_moved(f"{old_module}:{cls.__qualname__}", cls)


def wire_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def registered() -> dict[str, type]:
    return dict(_REGISTRY)


def moved() -> dict[str, type]:
    """The former names still decoded, each with its class (`register_moved`)."""
    return dict(_MOVED)


def encode(value: Any, depth: int = 0) -> Any:
    """A JSON-able form of `value` that `decode` turns back into an equal value."""
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested deeper than {MAX_DEPTH} levels cannot cross the wire")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if _REGISTRY.get(wire_name(cls)) is not cls:
            raise WireError(f"{wire_name(cls)} is not registered for the wire (a stage's WIRE_TYPES)")
        fields = {f.name: encode(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value) if f.init}
        return {CLASS: wire_name(cls), **fields}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise WireError(f"dict keys must be strings to cross as JSON: {sorted(map(repr, value))[:5]}")
        return {k: encode(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [encode(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, depth + 1) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {SET: [encode(v, depth + 1) for v in sorted(value, key=repr)]}
    if hasattr(value, "item") and callable(value.item):  # numpy / pyarrow scalars
        return encode(value.item(), depth)
    raise WireError(f"cannot send a {type(value).__name__} as JSON: {value!r:.100}")


def decode(data: Any, depth: int = 0) -> Any:
    """The value `encode` made; WireError for an unregistered class or a payload nested too deep."""
    if depth > MAX_DEPTH:
        raise WireError(f"refusing a payload nested deeper than {MAX_DEPTH} levels")
    if isinstance(data, list):
        return [decode(v, depth + 1) for v in data]
    if not isinstance(data, dict):
        return data
    if TUPLE in data:
        return tuple(decode(v, depth + 1) for v in _items(data, TUPLE))
    if SET in data:
        return {decode(v, depth + 1) for v in _items(data, SET)}
    if CLASS in data:
        cls = _REGISTRY.get(str(data[CLASS])) or _MOVED.get(str(data[CLASS]))
        if cls is None:
            raise WireError(f"refusing to build {str(data[CLASS])[:200]!r}: not a class registered for the wire")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(k for k in data if k != CLASS and k not in names)
        if unknown:
            raise WireError(f"{wire_name(cls)} has no field(s) {unknown[:5]}")
        try:
            return cls(**{k: decode(v, depth + 1) for k, v in data.items() if k != CLASS})
        except TypeError as exc:  # a missing field
            raise WireError(f"cannot build {wire_name(cls)}: {exc}") from None
    return {k: decode(v, depth + 1) for k, v in data.items()}


def _items(data: dict[str, Any], key: str) -> list[Any]:
    if len(data) != 1 or not isinstance(data[key], list):
        raise WireError(f"a {key} marker must hold one list")
    return data[key]


# -- reports: exactly one, signed with the run's key, of the stage's type -------------------------------

def sign_report(key: str, stage: str, report: Any) -> dict[str, Any]:
    """The Pipes message carrying `report` of `stage`, authenticated with the run's secret `key`."""
    payload = encode(report)
    return {REPORT: payload, MAC: _mac(key, stage, payload)}


def open_report(messages: Iterable[Any], key: str, stage: str, expected: type) -> Any:
    """The one report among a job's Pipes messages signed with `key` for `stage`, decoded and of
    type `expected`. Unsigned or forged report lines (anyone can print a Pipes-shaped line into the
    job's log) are refused; so are none, two, or one of another type."""
    reports = [m for m in messages if isinstance(m, dict) and REPORT in m]
    signed = [m for m in reports if _authentic(m, key, stage)]
    forged = len(reports) - len(signed)
    if len(signed) != 1:
        raise WireError(f"stage {stage}: {len(signed)} report(s) signed with this run's key, not exactly one"
                        + (f" ({forged} unsigned or forged report line(s) refused)" if forged else ""))
    report = decode(signed[0][REPORT])
    if not isinstance(report, expected):
        raise WireError(f"stage {stage}: the report is a {type(report).__name__}, not a {expected.__name__}")
    return report


def _authentic(message: dict[str, Any], key: str, stage: str) -> bool:
    mac = message.get(MAC)
    try:
        return isinstance(mac, str) and hmac.compare_digest(mac, _mac(key, stage, message[REPORT]))
    except (ValueError, TypeError, RecursionError):  # not even JSON we could have signed
        return False


def _mac(key: str, stage: str, payload: Any) -> str:
    body = json.dumps({"stage": stage, "report": payload}, sort_keys=True, separators=(",", ":"),
                      allow_nan=True).encode()
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def unsigned_reports(messages: Iterable[Any], key: str, stage: str) -> int:
    """How many report lines among `messages` were not signed with `key` (said in the run's log)."""
    return sum(1 for m in messages if isinstance(m, dict) and REPORT in m and not _authentic(m, key, stage))
