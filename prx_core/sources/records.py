"""The one record shape every source reader yields, and the reader-side refusals.

A reader cannot write `rejects` itself (it runs inside the `samples` stage's unit), so a sample
it refuses before reading its bytes (a symlink, an oversized member, a repeated key) comes
through as a record with empty image bytes and a `reject_reason`; `ingest_batch` turns that
into a `rejects` row. Nothing is dropped silently.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

RECORD_SCHEMA = pa.schema(
    [
        ("source_key", pa.string()),
        ("image", pa.large_binary()),
        ("caption", pa.string()),
        ("embedding", pa.list_(pa.float32())),
        ("reject_reason", pa.string()),  # null: a sample to decode; else refused by the reader
        ("reject_message", pa.string()),
        ("metadata", pa.map_(pa.string(), pa.string())),  # carried into samples.metadata (label, license, ...)
        ("source_url", pa.string()),  # where a fetched image came from (takedowns are traced by it)
    ]
)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
CAPTION_EXTENSIONS = ("txt", "caption")
BATCH_ROWS = 256
BATCH_BYTES = 64 << 20  # a batch also ends at this many image bytes: 256 large images stay bounded

# reasons a reader gives (the `rejects.reason` codes)
SYMLINK = "symlink"
NOT_REGULAR_FILE = "not_regular_file"
UNREADABLE_FILE = "unreadable_file"
IMAGE_TOO_LARGE = "image_too_large"
CAPTION_TOO_LARGE = "caption_too_large"
DUPLICATE_KEY = "duplicate_key"
NULL_KEY = "null_key"
BAD_NAME = "bad_name"  # a file or member name that is not UTF-8
DOWNLOAD_ERROR = "download_error"  # a URL that gave no image (HTTP status or exception in the message)
DOWNLOAD_TIMEOUT = "download_timeout"
NOT_FETCHED = "not_fetched"  # a URL row left when its unit's time for fetching ran out (the rest of the unit commits)
URL_NOT_ALLOWED = "url_not_allowed"  # an address, object or file the source may not reach (fetch.policy)
OPTED_OUT = "opted_out"  # the server said X-Robots-Tag noai / noimageai
TAKEN_DOWN = "taken_down"  # a key a recorded takedown names: refused before its bytes are fetched or stored
TAKEN_DOWN_MESSAGE = "taken down (a recorded opt-out --delete-bytes): never fetched nor stored again"
PATH_OUTSIDE_SOURCE = "path_outside_source"  # an image path (HF Image()) resolving outside the source root


def record(key: str, image: bytes = b"", caption: str | None = None, embedding: list[float] | None = None,
           metadata: dict[str, str] | None = None, source_url: str | None = None) -> dict[str, Any]:
    return {"source_key": key, "image": image, "caption": caption, "embedding": embedding,
            "reject_reason": None, "reject_message": None, "metadata": metadata or None, "source_url": source_url}


def refused(key: str, reason: str, message: str) -> dict[str, Any]:
    """A sample the reader refuses without reading it: no bytes, a reason for `rejects`."""
    return {**record(key), "reject_reason": reason, "reject_message": message[:300]}


def decode_caption(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").strip()


def printable_name(name: str) -> str:
    """A member or file name as valid UTF-8: undecodable bytes (kept as surrogates) become `\\xNN`."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


_UNSAFE_KEY = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def key_problem(key: str) -> str | None:
    """Why a source key cannot be a sample id, or None. C0/C1 control characters, DEL and lone
    surrogates (a non-UTF-8 name) would break SQL literals, paths and pages later, for good."""
    found = _UNSAFE_KEY.search(key)
    if found is None:
        return None
    return f"key holds the control or non-UTF-8 character {found.group()!r} at {found.start()}: refused"


def safe_key(key: str) -> str:
    """A refused key as printable text (`\\xNN` escapes), for the rejects row that names it."""
    return _UNSAFE_KEY.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), key)


def is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SeenKeys:
    """Keys already given in one fragment (as 128-bit hashes: a shard of 10^6 samples holds ~60 MB),
    so a repeated key becomes a `duplicate_key` reject instead of a second row with the same id."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def first(self, key: str) -> bool:
        """True the first time `key` is seen."""
        import xxhash

        digest = xxhash.xxh3_128_intdigest(key.encode("utf-8", "surrogateescape"))
        if digest in self.hashes:
            return False
        self.hashes.add(digest)
        return True


class Batches:
    """Collects rows into record batches of at most BATCH_ROWS rows or about BATCH_BYTES image bytes."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.size = 0

    def add(self, row: dict[str, Any]) -> Iterator[pa.RecordBatch]:
        self.rows.append(row)
        self.size += len(row["image"] or b"")
        if len(self.rows) >= BATCH_ROWS or self.size >= BATCH_BYTES:
            yield from self.flush()

    def flush(self) -> Iterator[pa.RecordBatch]:
        if self.rows:
            batch = pa.RecordBatch.from_pylist(self.rows, schema=RECORD_SCHEMA)
            self.rows, self.size = [], 0
            yield batch
