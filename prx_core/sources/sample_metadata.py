"""What a file-based reader (WebDataset, image folder) carries per sample besides the image.

`samples.metadata` is a string map: a class label (`label`, from a `.cls` member or a class
folder), the other fields of a JSON member or a metadata-file row (license, width, similarity,
...), and `caption_error`, the note saying why a sample has no source caption although its files
promised one (a JSON member that does not parse, a row without the caption column). The note is
never a reject: the image is fine, and the operator sees and filters it in `samples.metadata`.
Values follow the table sources' rule (`prx_core.sources.tables.metadata_values`): scalars as
text, anything nested as compact JSON, 1000 characters at most; at most MAX_FIELDS fields a sample.
"""

from __future__ import annotations

import json
import re
from typing import Any

LABEL = "label"
CAPTION_ERROR = "caption_error"
MAX_VALUE_CHARS = 1000
MAX_FIELDS = 32  # of a JSON member or a metadata row; the rest are not carried
MAX_NAME_CHARS = 100
_SURROGATES = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` as valid UTF-8: JSON may escape lone surrogates (`"\\ud800"`), which Arrow cannot
    store (a whole batch would fail); each becomes U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)


def metadata_text(value: Any) -> str | None:
    """`value` as a metadata string (None stays None: an absent field is no field)."""
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        return valid_text(json.dumps(value, default=repr, separators=(",", ":"))[:MAX_VALUE_CHARS])
    return valid_text(str(value)[:MAX_VALUE_CHARS])


def caption_value(value: Any) -> str | None:
    """A caption field's value as a caption: text (stripped), or a number as text; None for
    anything else (null, an object, a list: no caption)."""
    if isinstance(value, str):
        return valid_text(value.strip())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def other_fields(obj: dict[str, Any], skip: set[str]) -> dict[str, str]:
    """The fields of a JSON object or a metadata row as metadata, except `skip` and nulls; the
    first MAX_FIELDS names of at most MAX_NAME_CHARS characters."""
    out: dict[str, str] = {}
    for name, value in obj.items():
        if len(out) >= MAX_FIELDS:
            break
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or name in skip:
            continue
        text = metadata_text(value)
        if text is not None and text != "":
            out[valid_text(name)] = text
    return out


def field_at(obj: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) of a dotted field path inside a JSON object (`("meta", "caption")`)."""
    for name in path:
        if not isinstance(obj, dict) or name not in obj:
            return False, None
        obj = obj[name]
    return True, obj


def parse_json_object(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(object, None), or (None, why not): a JSON member or line that does not parse, or is not
    an object, is a note, never an exception (a deeply nested one included)."""
    try:
        obj = json.loads(data.decode("utf-8-sig"))  # a BOM (Windows tools) is no error
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"not valid JSON ({type(exc).__name__}: {str(exc)[:120]})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (a {type(obj).__name__})"
    return obj, None
