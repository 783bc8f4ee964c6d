"""Data versions from content, so an idempotent rerun leaves everything downstream fresh.

A Lance version changes on every commit, even one that rewrote the same rows; a data version must
change only when what the partition holds does. Two ways, chosen per asset, both O(1) or O(streams)
on the driver, never a scan of a partition:

- `content_version`: a digest of the asset's code version, its upstream data versions (this
  partition's; every source's for the global `duplicates`) and the outcome counts the stage
  reported. For the Lance stages the rows are a function of those inputs (buckets of sizes, hashes
  of pixels, model outputs reused per content and model version), and the counts catch what is
  not (a failure retried and now captioned, a unit that became `unreadable_fragment` rejects).
- `streams_version`: the MDS streams themselves. Their chunk folders are named after everything
  their bytes depend on (`c-<digest>`), and a stream's index is its chunks in order, so the
  ordered chunk names of every stream are a digest of the bytes a trainer reads.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import extract_data_version_from_entry

from prx_assets.common import SOURCES

GLOBAL = {"duplicates"}  # the one unpartitioned asset


def digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def latest_version(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None) -> str | None:
    record = instance.get_latest_data_version_record(key, is_source=False, partition_key=partition)
    version = extract_data_version_from_entry(record.event_log_entry) if record else None
    return version.value if version else None


def upstream_versions(context: dg.AssetExecutionContext) -> dict[str, Any]:
    """The data version of every dependency of this materialization, read from the instance (one
    event-log lookup per dependency and partition)."""
    instance, out = context.instance, {}
    partition = context.partition_key if context.has_partition_key else None
    for dep in sorted(context.assets_def.specs_by_key[context.asset_key].deps, key=lambda d: d.asset_key.to_string()):
        name = dep.asset_key.to_user_string()
        if name in GLOBAL or partition is not None:
            out[name] = latest_version(instance, dep.asset_key, None if name in GLOBAL else partition)
        else:  # the global asset over a per-source one: every source's, by name
            out[name] = {p: latest_version(instance, dep.asset_key, p)
                         for p in sorted(instance.get_dynamic_partitions(SOURCES.name))}
    return out


def content_version(context: dg.AssetExecutionContext, own_part: dict[str, Any] | None = None,
                    **outcome: Any) -> dg.DataVersion:
    """digest(code version, upstream data versions, the stage's outcome counts). `own_part` replaces
    the data version of a global dependency by a digest of this partition's part of it: the
    `duplicates` version changes with every source's run, this source's groups rarely."""
    code = context.assets_def.code_versions_by_key.get(context.asset_key)
    return dg.DataVersion(digest(code, {**upstream_versions(context), **(own_part or {})}, outcome))


def streams_version(streams: list[Any]) -> dg.DataVersion:
    """The published streams' names and their chunk names in order (content-addressed)."""
    return dg.DataVersion(digest(sorted((s.name, list(s.chunks)) for s in streams)))
