"""Skip-list completion records: proof that a stream's skip-lists were computed, also when empty.

A stream with nothing to skip has no `.skip` file, so "no files" cannot tell "nothing to skip"
from "`skip_lists` never ran, or failed". Each stream folder under `<root>/skiplists/` therefore
gets `_complete.json`, written last by the run that wrote its lists: the stream, its size, the
SHA-256 of the index.json the lists were computed for, the policy version, the reasons the policy
applied and how many samples each skipped. The training loader refuses a stream without a
record for its current index (`check_record`): it fails closed, never trains unfiltered by
accident.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prx_core.store.storage import join_uri, put_atomic

RECORD = "_complete.json"
RECORD_VERSION = 1


class UnfilteredStream(ValueError):
    """A stream the loader must not train on: its skip-lists are missing or stale."""


def record_uri(stream_folder: str) -> str:
    return join_uri(stream_folder, RECORD)


def write_record(fs: Any, stream_folder: str, header: Mapping[str, Any], applied: Sequence[str],
                 counts: Mapping[str, int], pending: str | None = None) -> str:
    """Write the stream's record (after its lists: a crash between them leaves no record, so the
    loader refuses rather than trusting half-written lists). Idempotent: no timestamp. `pending`
    says why the stream has no lists yet (a merged stream waiting for a member's): refused with it."""
    record = {"format_version": RECORD_VERSION, "stream": header["stream"], "source": header["source"],
              "stream_size": int(header["stream_size"]), "index_digest": header["index_digest"],
              "policy_version": header["policy_version"], "reasons_applied": sorted(set(applied)),
              "counts": {r: int(n) for r, n in sorted(counts.items()) if n}}
    if pending:
        record["pending"] = pending
    uri = record_uri(stream_folder)
    put_atomic(fs, uri, json.dumps(record, sort_keys=True, indent=1).encode())
    return uri


def read_record(fs: Any, stream_folder: str) -> dict[str, Any] | None:
    uri = record_uri(stream_folder)
    try:
        data = fs.cat_file(uri)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise UnfilteredStream(f"{uri}: unreadable skip-list record ({exc}): re-materialize skip_lists") from exc
    return record if isinstance(record, dict) else None


def check_record(record: dict[str, Any] | None, name: str, count: int, digest: str, reasons: Sequence[str]) -> None:
    """Raise `UnfilteredStream` naming the stream and the fix unless `record` says its skip-lists
    were computed for this very index.json (`digest`, `count`) and every reason it counted has its
    list among `reasons` (the `.skip` files present)."""
    source = name.split("/", 1)[0]
    fix = f"materialize skip_lists for source {source!r} (or pass allow_unfiltered=True to train on it unfiltered)"
    if record is None:
        raise UnfilteredStream(f"stream {name} has no skip-list record: skip_lists never completed for it since it "
                               f"was last published, so its duplicates, nsfw, text and opted-out samples are not "
                               f"known; {fix}")
    if record.get("pending"):
        raise UnfilteredStream(str(record["pending"]))
    if record.get("index_digest") != digest or record.get("stream_size") != count:
        raise UnfilteredStream(
            f"the skip-lists of {name} were computed for another version of stream {name} "
            f"({record.get('stream_size')} samples, index {str(record.get('index_digest'))[:12]}; the stream has "
            f"{count}, index {digest[:12]}, republished since): re-materialize skip_lists for {source} "
            "(or pass allow_unfiltered=True to train on it unfiltered)")
    missing = sorted(r for r, n in (record.get("counts") or {}).items() if n and r not in reasons)
    if missing:
        raise UnfilteredStream(f"stream {name}: its record counts skipped samples for {missing} but the "
                               f"skip-list files are missing; {fix}")
