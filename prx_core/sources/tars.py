"""WebDataset tar shards: members `<key>.<ext>` grouped by key in archive order.

Bounded by construction: a member's size is checked from its header before anything is read
(an oversized image or caption makes its sample an `image_too_large` / `caption_too_large`
reject, the shard goes on), members the reader does not need are never read (a plain `.tar` is
opened seekable, so they are skipped by seeking; a `.tar.gz` / `.tgz` is gunzipped as a stream
in fixed-size blocks), and the member list tarfile keeps is cleared as it goes. A `.tar` that
is really gzip is refused with a clear error (the shard becomes one `unreadable_fragment`
reject): a shard is decompressed only when its name says so.

Captions (`caption_rule`): a text member (`txt` or `caption` by default) or a field of the JSON
member (`json.caption`); a `.cls` member is the `label` metadata value; the JSON member's `url`
is `source_url` and its other fields are metadata (`prx_core.sources.sample_metadata`). A JSON
member that does not parse, or lacks the configured field, leaves the sample without a caption
and says so in its `caption_error` metadata (counted in the worker's log per shard): the image
is fine, so it is no reject.
"""

from __future__ import annotations

import logging
import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import pyarrow as pa

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.records import (
    BAD_NAME,
    CAPTION_EXTENSIONS,
    CAPTION_TOO_LARGE,
    DUPLICATE_KEY,
    IMAGE_EXTENSIONS,
    IMAGE_TOO_LARGE,
    NOT_REGULAR_FILE,
    Batches,
    SeenKeys,
    decode_caption,
    is_utf8,
    printable_name,
    record,
    refused,
)
from prx_core.sources.sample_metadata import (
    CAPTION_ERROR,
    LABEL,
    caption_value,
    field_at,
    metadata_text,
    other_fields,
    parse_json_object,
)
from prx_core.sources.tar_headers import BoundedTarInfo
from prx_core.store.storage import filesystem_for

log = logging.getLogger(__name__)

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
GZIP_SUFFIXES = (".tar.gz", ".tgz")
GZIP_MAGIC = b"\x1f\x8b"
JSON_EXT, CLASS_EXT = "json", "cls"
MAX_CLASS_BYTES = 256  # a `.cls` member is a class index or name: a bigger one is a note, not read


def is_shard(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIXES)


def member_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member: its path up to the first dot of its base name, and the rest
    (`a/b.x.jpg` -> `a/b`, `x.jpg`). Distinct keys within a shard are distinct samples."""
    base = posixpath.basename(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(posixpath.dirname(name), stem), ext.lower()


def read_webdataset(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    """The samples of one shard; the first image and the first caption member of a sample win."""
    caption_rule(spec.caption_column)  # a bad caption_column fails before the shard is opened
    fs = filesystem_for(path, storage_options)
    gzipped = path.lower().endswith(GZIP_SUFFIXES)
    with fs.open(path, "rb") as handle:
        if not gzipped and handle.read(2) == GZIP_MAGIC:
            raise ValueError(f"{path} is gzip-compressed but named .tar: rename it .tar.gz (or .tgz) to have it "
                             "read as a compressed shard")
        handle.seek(0)
        mode = "r|gz" if gzipped else "r:"
        with tarfile.open(fileobj=handle, mode=mode, encoding="utf-8", errors="surrogateescape",
                          tarinfo=BoundedTarInfo) as tar:
            yield from _samples(spec, tar, path)


class CaptionRule(NamedTuple):
    """Which members of a sample give its caption (`caption_column`, see `caption_rule`)."""

    text_exts: tuple[str, ...]  # members read whole as the caption, the first in the shard winning
    json_ext: str  # the JSON member read for its caption field, `url` and other fields
    json_paths: tuple[tuple[str, ...], ...]  # caption fields tried in order
    explicit: bool  # named by the catalog: a sample lacking it gets a `caption_error` note


def caption_rule(caption_column: str | None) -> CaptionRule:
    """`txt` (any member extension): that member; `json.caption` (`ext.field`, deeper fields
    dotted, `meta.json.caption` for a `.meta.json` member): a field of a JSON member, the
    extension ending at the first `json` part. None: `txt` / `caption`, then the `.json`
    member's `caption`, then its `text`. The JSON member (`.json`, or the one named) is read in
    every case: its `url` is the sample's `source_url`, its other fields go to metadata."""
    if not caption_column:
        return CaptionRule(CAPTION_EXTENSIONS, JSON_EXT, (("caption",), ("text",)), False)
    parts = caption_column.split(".")
    lowered = [p.lower() for p in parts]
    if "" in lowered:
        raise ValueError(f"caption_column {caption_column!r}: an empty part between dots")
    if JSON_EXT in lowered:
        at = lowered.index(JSON_EXT)
        if at == len(parts) - 1:
            raise ValueError(f"caption_column {caption_column!r} names a JSON member but no field in it "
                             f"(e.g. {caption_column}.caption)")
        return CaptionRule((), ".".join(lowered[:at + 1]), (tuple(parts[at + 1:]),), True)
    return CaptionRule((caption_column.lower(),), JSON_EXT, (), True)


class _Sample:
    def __init__(self, key: str, problem: tuple[str, str] | None = None) -> None:
        self.key, self.problem = key, problem
        self.image: bytes | None = None
        self.text: str | None = None
        self.json: dict[str, Any] | None = None
        self.label: str | None = None
        self.seen: set[str] = set()  # the caption members met (read or not)
        self.notes: list[str] = []

    def row(self, rule: CaptionRule) -> dict[str, Any]:
        if self.problem:
            return refused(printable_name(self.key), *self.problem)
        caption, metadata, url = self.text, {}, None
        if self.json is not None:
            used = None  # the JSON field that became the caption: not metadata too (a losing one is)
            if caption is None and rule.json_paths:
                caption, used = self._json_caption(rule)
            metadata = other_fields(self.json, {"url", used} if used else {"url"})
            url = metadata_text(self.json["url"]) if isinstance(self.json.get("url"), str) else None
        named = (rule.json_ext if rule.json_paths else rule.text_exts[0]) if rule.explicit else None
        if named and named not in self.seen:
            self.notes.append(f"no .{named} member")
        if self.label is not None:
            metadata[LABEL] = self.label
        if self.notes:
            metadata[CAPTION_ERROR] = "; ".join(self.notes)[:300]
        return record(self.key, self.image or b"", caption, metadata=metadata, source_url=url)

    def _json_caption(self, rule: CaptionRule) -> tuple[str | None, str | None]:
        """(caption, the top-level field it came from) out of the JSON member."""
        for path in rule.json_paths:
            found, value = field_at(self.json, path)
            if found:
                caption = caption_value(value)
                if caption is None:
                    self.notes.append(f".{rule.json_ext} field {'.'.join(path)!r} is not text")
                return caption, path[0]
        if rule.explicit:
            self.notes.append(f".{rule.json_ext} member has no field {'.'.join(rule.json_paths[0])!r}")
        return None, None

    def take(self, rule: CaptionRule, ext: str, member: tarfile.TarInfo, spec: SourceSpec) -> str | None:
        """What to do with a member: 'image', 'text', 'json', 'cls' (read it), or None (never read it;
        a refusal or a note set here when it is needed but may not be read)."""
        kind = ("image" if ext in IMAGE_EXTENSIONS and self.image is None else
                "text" if ext in rule.text_exts and self.text is None else
                "json" if ext == rule.json_ext and self.json is None and rule.json_ext not in self.seen else
                "cls" if ext == CLASS_EXT and self.label is None and CLASS_EXT not in self.seen else None)
        if kind is None:
            return None
        self.seen.add(ext)
        if not member.isfile():
            self.problem = (NOT_REGULAR_FILE, f"member {member.name!r} is a link or a special file")
            return None
        limit = {"image": spec.max_image_bytes, "cls": MAX_CLASS_BYTES}.get(kind, spec.max_caption_bytes)
        if member.size <= limit:
            return kind
        message = f"member {member.name!r} has {member.size} bytes, over the limit {limit}"
        if kind == "image":
            self.problem = (IMAGE_TOO_LARGE, message)
        elif kind == "text" or (kind == "json" and rule.explicit and rule.json_paths):
            self.problem = (CAPTION_TOO_LARGE, message)
        else:  # metadata only: the image and its caption are still good
            self.notes.append(f"{message}: not read")
        return None

    def keep(self, kind: str, ext: str, payload: bytes) -> None:
        if kind == "image":
            self.image = payload
        elif kind == "text":
            self.text = decode_caption(payload)
        elif kind == "cls":
            self.label = decode_caption(payload) or None
        else:
            self.json, problem = parse_json_object(payload)
            if problem:
                self.notes.append(f".{ext} member {problem}")


def _samples(spec: SourceSpec, tar: tarfile.TarFile, path: str) -> Iterator[pa.RecordBatch]:
    rule = caption_rule(spec.caption_column)
    batches = Batches()
    seen = SeenKeys()
    notes = _Notes(path)
    current: _Sample | None = None
    while True:
        try:
            member = tar.next()
        except Exception:  # a corrupt or refused header: hand out what was read, lose only the rest
            if current is not None:
                yield from batches.add(notes.count(current.row(rule)))
            yield from batches.flush()
            notes.log()
            raise
        if member is None:
            break
        tar.members.clear()  # tarfile keeps every header otherwise: memory grows with the member count
        if member.isdir():
            continue
        key, ext = member_key(member.name)
        if current is None or current.key != key:
            if current is not None:
                yield from batches.add(notes.count(current.row(rule)))
            current = _Sample(key)
            if not is_utf8(key):
                current.problem = (BAD_NAME, f"member {printable_name(member.name)!r}: name is not UTF-8")
            elif not seen.first(key):
                current.problem = (DUPLICATE_KEY, f"key {key!r} appears again in the shard: the first is kept")
        if current.problem:
            continue
        kind = current.take(rule, ext, member, spec)
        if kind is None:
            continue  # not needed (never read), or refused from its header
        if member.refusal:  # a sparse member the sample needs: never expanded (prx_core.sources.tar_headers)
            current.problem = (NOT_REGULAR_FILE, f"member {printable_name(member.name)!r} is {member.refusal}")
            continue
        handle = tar.extractfile(member)
        current.keep(kind, ext, handle.read(member.size) if handle is not None else b"")  # checked: at most the limit
    if current is not None:
        yield from batches.add(notes.count(current.row(rule)))
    yield from batches.flush()
    notes.log()


class _Notes:
    """Counts a shard's samples with a `caption_error` note, logged once per shard (the notes
    themselves are in `samples.metadata`)."""

    def __init__(self, path: str) -> None:
        self.path, self.noted, self.first = path, 0, ""

    def count(self, row: dict[str, Any]) -> dict[str, Any]:
        note = (row.get("metadata") or {}).get(CAPTION_ERROR)
        if note:
            self.noted += 1
            self.first = self.first or f"{row['source_key']}: {note}"
        return row

    def log(self) -> None:
        if self.noted:
            log.warning("%s: %d samples with a caption_error note in samples.metadata (first: %s)",
                        self.path, self.noted, self.first)
