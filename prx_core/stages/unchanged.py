"""A rerun that has nothing to do: the manifest last committed, its outputs still there.

A stage declared `reusable` records, after each committed run whose report it says may stand
again (samples: one that kept rows), its manifest digest, the Lance versions it wrote and its report (`<root>/_reports/<asset>/<partition>/latest.json`).
When the next run pins the same manifest (same inputs, code version and settings) and each table
it wrote still exists at that version or later, it returns that report, every unit counted as
skipped, and runs and commits nothing: the weekly refresh of an unchanged 100M-image source is a
listing, not 40 TB re-ingested. Every other stage records the same without a report after each
commit: `last_commit`, by which the explorer follows one source's runs of the content-keyed tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from prx_core.compute import wire
from prx_core.compute.unit_results import REPORTS, map_unit_results
from prx_core.store import lance_io
from prx_core.store.storage import Storage, put_atomic

LATEST = "latest.json"


def latest_uri(storage: Storage, asset: str, partition: str) -> str:
    return storage.uri(REPORTS, asset, partition, LATEST)


def read_latest(storage: Storage, asset: str, partition: str) -> dict[str, Any] | None:
    """The record of the last committed run of (asset, partition), None before the first (ValueError:
    a damaged record)."""
    fs, uri = storage.filesystem(), latest_uri(storage, asset, partition)
    fs.invalidate_cache()
    return json.loads(fs.cat_file(uri)) if fs.exists(uri) else None


def record_committed(storage: Storage, asset: str, partition: str, digest: str, versions: Mapping[str, int | None],
                     report: Any | None) -> None:
    """The last committed run of (asset, partition): its manifest digest, the versions it wrote and,
    for a reusable stage, its report (None: a stage whose runs are recorded only for `last_commit`)."""
    payload: dict[str, Any] = {"digest": digest, "versions": {k: v for k, v in versions.items() if v is not None}}
    if report is not None:
        payload["report"] = wire.encode(report)
    put_atomic(storage.filesystem(), latest_uri(storage, asset, partition), json.dumps(payload).encode())


def force_next_run(storage: Storage, asset: str, partition: str) -> bool:
    """Make the next run of (asset, partition) run even over unchanged inputs (a reader fixed without
    a code version change, a test of the run itself): its record loses the report a rerun would
    stand on. Digest and versions stay, so the stages that follow it (`last_commit`) see no change
    until that run commits. False when there is no report to drop."""
    payload = read_latest(storage, asset, partition)
    if payload is None or payload.pop("report", None) is None:
        return False
    put_atomic(storage.filesystem(), latest_uri(storage, asset, partition), json.dumps(payload).encode())
    return True


def last_commit(storage: Storage, asset: str, partition: str) -> str | None:
    """A digest of the last committed run of (asset, partition) (manifest and versions written), None
    before the first: what a downstream stage pins to follow this partition's runs of a shared table,
    which other partitions' runs move."""
    payload = read_latest(storage, asset, partition)
    if payload is None:
        return None
    return hashlib.sha256(json.dumps([payload.get("digest"), payload.get("versions")]).encode()).hexdigest()[:24]


def committed_report(storage: Storage, asset: str, partition: str, digest: str, report_type: type) -> Any | None:
    """The report of the last committed run of `digest`, its units all skipped, if every table it
    wrote is still at that version or later; None when there is work to do. The module that declared
    the stage registered `report_type` and what it nests for decoding (its `WIRE_TYPES`)."""
    try:
        payload = read_latest(storage, asset, partition)
        if payload is None:
            return None
        report = wire.decode(payload["report"])
    except (ValueError, KeyError, wire.WireError):  # an older layout or a damaged record: do the work
        return None
    if payload.get("digest") != digest or not isinstance(report, report_type):
        return None
    options = storage.lance_storage_options()
    for table, version in payload["versions"].items():
        current = lance_io.table_version(storage.lance_uri(table), options)
        if current is None or current < version:  # dropped or restored to before the commit
            return None
    return map_unit_results(report, lambda r, _: dataclasses.replace(r, ran=0, skipped=r.units, seconds=0.0))
