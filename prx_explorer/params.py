"""Query values, checked in one place: a malformed, out-of-range or over-long value is the
client's error (a 400 naming the parameter), never a 500 from `int()` deep in a handler.

Numbers are ASCII digits only: `str.isdigit` accepts '²' and '١', which `int()` refuses or
reads, and 5,000 digits exceed Python's integer-parsing limit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from prx_core.stages.explorer.rows import MAX_META_VALUE  # longer values are shown, not filtered on

MAX_TEXT = 500  # characters: a sample id, a reason or a search, never a document
MAX_META_KEY = 64  # characters of a metadata key in the `meta` filter
MAX_DIGITS = 9
_DIGITS = re.compile(r"[0-9]{1,%d}" % MAX_DIGITS)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadRequest(Exception):
    """A query value the explorer refuses; the message names the parameter and the rule."""

    def __init__(self, name: str, rule: str) -> None:
        super().__init__(f"query parameter {name!r}: {rule}")
        self.name = name


def text_param(params: Mapping[str, str], name: str, default: str = "") -> str:
    """A free-text value (search words, a sample id, a filter value), stripped of outer spaces."""
    value = str(params.get(name, default))
    if len(value) > MAX_TEXT:
        raise BadRequest(name, f"longer than {MAX_TEXT} characters")
    if _CONTROL.search(value):
        raise BadRequest(name, "control characters are not allowed")
    return value.strip()


def int_param(params: Mapping[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    """A whole number in [low, high]; absent or empty gives `default` (a form's "any")."""
    raw = str(params.get(name, "")).strip(" ")
    if raw == "":
        return default
    if not _DIGITS.fullmatch(raw):
        raise BadRequest(name, f"must be a whole number from {low} to {high} (ASCII digits)")
    value = int(raw)
    if not low <= value <= high:
        raise BadRequest(name, f"must be from {low} to {high}")
    return value


def choice_param(params: Mapping[str, str], name: str, choices: Sequence[str], default: str) -> str:
    """One of `choices`; absent or empty gives `default`."""
    raw = str(params.get(name, "")).strip(" ")
    if raw == "":
        return default
    if raw not in choices:
        raise BadRequest(name, "must be one of " + ", ".join(choices))
    return raw


def meta_param(params: Mapping[str, str], name: str) -> str:
    """A metadata filter `key:value` (split at the first colon; the value may hold more), both
    parts stripped, the key non-empty; "" when absent."""
    raw = text_param(params, name)
    if raw == "":
        return ""
    key, colon, value = raw.partition(":")
    key, value = key.strip(), value.strip()
    if not colon or not key:
        raise BadRequest(name, "must be key:value, e.g. label:cat")
    if len(key) > MAX_META_KEY:
        raise BadRequest(name, f"key longer than {MAX_META_KEY} characters")
    if len(value) > MAX_META_VALUE:
        raise BadRequest(name, f"value longer than {MAX_META_VALUE} characters")
    return f"{key}:{value}"
