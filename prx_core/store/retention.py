"""Which old Lance versions `compact_table` may remove: aged from supersession, never a pinned one.

Lance's `cleanup_old_versions(older_than=...)` ages a version from its creation, so a version
written 8 days ago and replaced a minute ago went at the next compaction under a stage still
reading it (`Not found`). Here a version may go only when (a) it is not the latest, (b) no
uncommitted attempt under `_runs/` pinned it as an input (`prx_core.compute.units`: an attempt
resumes on the versions its manifest names, so a crashed one needs them too), and (c) the
version after it was created at least the retention ago: readers had that long to move on.
Tagged versions stay (Lance never removes them). Pure library: never imports dagster.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lance import LanceDataset

from prx_core.store.storage import COMMITTED, RUNS, Storage


@dataclass(frozen=True)
class VersionCleanup:
    """What a cleanup removed, and what it kept that creation-time aging would have removed."""

    removed: int  # versions removed (a tagged one is skipped by Lance)
    bytes_removed: int
    kept_pinned: list[int]  # old enough to go, kept because a live attempt pinned them
    kept_recent: list[int]  # superseded less than the retention ago


def pinned_versions(storage: Storage) -> dict[str, set[int]]:
    """Table name -> the versions pinned by every uncommitted attempt (`_runs/<asset>/<partition>/
    <digest>/run.json`, manifest `inputs`: table name -> version). A damaged record raises
    `ValueError` naming it: what it pinned is unknown, so nothing may be cleaned."""
    fs = storage.filesystem()
    base = storage.uri(RUNS)
    fs.invalidate_cache()
    pins: dict[str, set[int]] = defaultdict(set)
    if not fs.exists(base):
        return {}
    for path in sorted(fs.glob(f"{base.rstrip('/')}/*/*/*/run.json")):
        attempt = path.rsplit("/", 1)[0]
        if fs.exists(f"{attempt}/{COMMITTED}"):
            continue  # committed: its outputs are live and it no longer reads its inputs
        try:
            inputs = json.loads(fs.cat_file(path))["manifest"]["inputs"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: unreadable run record, cannot tell which versions it pins ({exc})") from exc
        for table, version in _version_inputs(inputs):
            pins[table].add(version)
    return dict(pins)


def _version_inputs(inputs: Mapping[str, Any]) -> Iterable[tuple[str, int]]:
    for name, value in inputs.items():
        if isinstance(value, int) and not isinstance(value, bool):
            yield name, value


def removable_versions(versions: Iterable[Mapping[str, Any]], retention_seconds: float, pinned: Collection[int],
                       now: float) -> tuple[list[int], list[int], list[int]]:
    """(removable, kept because pinned, kept because superseded less than the retention ago) among
    `versions` (Lance's `versions()`: number and creation timestamp). The successor of a version is
    the next one still listed: after earlier cleanups that is later, so a version only stays longer."""
    ordered = sorted(versions, key=lambda v: int(v["version"]))
    removable, kept_pinned, kept_recent = [], [], []
    for current, successor in zip(ordered, ordered[1:]):
        number = int(current["version"])
        superseded_for = now - _seconds(successor["timestamp"])
        if superseded_for < retention_seconds:
            kept_recent.append(number)
        elif number in pinned:
            kept_pinned.append(number)
        else:
            removable.append(number)
    return removable, kept_pinned, kept_recent


def cleanup_superseded(ds: LanceDataset, retention: timedelta, pinned: Collection[int] = (),
                       now: float | None = None) -> VersionCleanup:
    """Remove exactly the removable versions of `ds` (never the latest or a tagged one), aged at
    `now` (the time of the call unless given)."""
    now = time.time() if now is None else now
    removable, kept_pinned, kept_recent = removable_versions(ds.versions(), retention.total_seconds(), set(pinned), now)
    if not removable:
        return VersionCleanup(0, 0, kept_pinned, kept_recent)
    stats = ds.cleanup_old_versions(versions=removable, error_if_tagged_old_versions=False)
    return VersionCleanup(int(stats.old_versions), int(stats.bytes_removed), kept_pinned, kept_recent)


def _seconds(timestamp: Any) -> float:
    """Epoch seconds of a Lance version timestamp (a naive local datetime, or a number)."""
    return float(timestamp.timestamp()) if hasattr(timestamp, "timestamp") else float(timestamp)
