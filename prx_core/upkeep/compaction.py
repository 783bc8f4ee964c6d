"""Compaction that keeps partitions apart: no fragment ever holds rows of two partitions.

Lance's `compact_files` merges any small fragments, so afterwards a fragment mixes sources and
replacing one source has to put deletion vectors on every fragment it shares with the others
(plan compaction per source: docs/architecture.md). Here the small fragments and the fragments with deleted
rows of each partition (a source, or a (source, stage) pair for `rejects`) are merged among
themselves and fragments that already mix partitions are split back, in one `Update` commit: the operation a partition replace makes, so the
same conflict rules hold between the two. `compact_table` is what the nightly compact_corpus job runs per table.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pyarrow as pa
from lance import LanceDataset, LanceOperation
from lance.commit import CommitConflictError

from prx_core.compute.parallel import imap_tasks
from prx_core.store.maintenance import catch_up_indexes
from prx_core.store.retention import cleanup_superseded
from prx_core.store.lance_io import (
    StorageOptions,
    backoff,
    fragments_from_json,
    require_table,
    sql_literal,
    write_fragments,
)

log = logging.getLogger(__name__)
Key = tuple[object, ...]


@dataclass(frozen=True)
class PartitionCompaction:
    """What `compact_partitions` rewrote: fragments removed and written, partitions touched."""

    removed: int
    written: int
    partitions: int
    mixed_split: int  # fragments that held rows of more than one partition
    version: int


def plan_compaction(ds: LanceDataset, columns: Sequence[str], target_rows: int, small_fraction: float = 0.5,
                    deleted_fraction: float = 0.1) -> tuple[dict[Key, list[int]], int]:
    """Fragment ids to rewrite per partition key, and how many fragments mix partitions.

    A partition is rewritten when it has two or more small fragments, a fragment with more than
    `deleted_fraction` of its rows deleted (Lance's own threshold), or rows in a mixed fragment;
    a lone healthy fragment is left alone."""
    keys_of = {f.fragment_id: fragment_keys(ds, f.fragment_id, columns) for f in ds.get_fragments()}
    pure: dict[Key, list[int]] = defaultdict(list)  # fragments holding one partition, by partition
    shared: dict[Key, list[int]] = defaultdict(list)  # fragments mixing it with others
    for fragment_id, keys in keys_of.items():
        for key in keys:
            (pure if len(keys) == 1 else shared)[key].append(fragment_id)
    metas = {f.fragment_id: f.metadata for f in ds.get_fragments()}
    plan: dict[Key, list[int]] = {}
    for key in pure.keys() | shared.keys():
        small = [i for i in pure[key] if metas[i].num_rows < small_fraction * target_rows]
        deleted = [i for i in pure[key]
                   if metas[i].num_deletions > deleted_fraction * (metas[i].num_rows + metas[i].num_deletions)]
        if len(small) >= 2 or deleted or shared[key]:
            plan[key] = sorted(set(small) | set(deleted) | set(shared[key]))
    return plan, sum(1 for keys in keys_of.values() if len(keys) > 1)


def fragment_keys(ds: LanceDataset, fragment_id: int, columns: Sequence[str]) -> set[Key]:
    """The partition keys in one fragment. Almost every fragment holds one partition: its first
    row's key and one indexed count prove it; only a mixed fragment is scanned (by batches)."""
    fragment = ds.get_fragment(fragment_id)
    first = fragment.to_table(columns=list(columns), limit=1).to_pylist()
    if not first:
        return set()
    key = tuple(first[0][c] for c in columns)
    if fragment.count_rows(partition_predicate(columns, key)) == fragment.count_rows():
        return {key}
    keys: set[Key] = set()
    for batch in fragment.scanner(columns=list(columns), batch_size=1 << 16).to_batches():
        distinct = pa.Table.from_batches([batch]).group_by(list(columns)).aggregate([])
        keys |= set(zip(*(distinct[c].to_pylist() for c in columns)))
    return keys


def partition_predicate(columns: Sequence[str], key: Key) -> str:
    return " AND ".join(f"{c} IS NULL" if v is None else f"{c} = {sql_literal(str(v))}" for c, v in zip(columns, key))


def rewrite_partition(uri: str, version: int, fragment_ids: list[int], predicate: str, target_rows: int,
                      storage_options: StorageOptions) -> list[dict]:
    """Ray task: one partition's rows of the given fragments, rewritten into new fragments of up to
    `target_rows` rows (no commit); the rows, image bytes included, never pass through the driver."""
    ds = require_table(uri, storage_options).checkout_version(version)
    scanner = ds.scanner(fragments=[ds.get_fragment(i) for i in fragment_ids], filter=predicate)
    written = write_fragments(uri, scanner.to_reader(), ds.schema, storage_options, max_rows_per_file=target_rows)
    return [f.to_json() for f in written]


def compact_partitions(uri: str, columns: Sequence[str], target_rows: int = 1_000_000,
                       storage_options: StorageOptions = None, max_retries: int = 3) -> PartitionCompaction:
    """Merge each partition's small fragments, split mixed ones, in one commit; rows unchanged.
    The driver plans from fragment metadata and indexed counts; one Ray task per partition rewrites.

    On a conflict (a partition replace committed meanwhile) the plan is made again from the new
    version; fragments written for the lost attempt are never referenced and go with the
    orphan cleanup of `cleanup_old_versions`."""
    for attempt in range(max_retries + 1):
        ds = require_table(uri, storage_options)
        plan, mixed = plan_compaction(ds, columns, target_rows)
        if not plan:
            return PartitionCompaction(0, 0, 0, 0, ds.version)
        calls = ((uri, ds.version, ids, partition_predicate(columns, key), target_rows, storage_options)
                 for key, ids in sorted(plan.items(), key=lambda item: repr(item[0])))
        new = [f for _, written in imap_tasks(rewrite_partition, calls) for f in fragments_from_json(written)]
        removed = sorted({i for ids in plan.values() for i in ids})
        try:
            op = LanceOperation.Update(removed_fragment_ids=removed, new_fragments=new)
            version = LanceDataset.commit(ds, op, read_version=ds.version).version
        except CommitConflictError as exc:
            log.info("%s: compaction conflicted (attempt %d), planning again: %s", uri, attempt + 1, exc)
            backoff(attempt)
            continue
        return PartitionCompaction(len(removed), len(new), len(plan), mixed, version)
    raise RuntimeError(f"{uri}: compaction still conflicted after {max_retries} retries")


@dataclass(frozen=True)
class CompactionReport:
    fragments_before: int
    fragments_after: int
    versions_removed: int
    bytes_removed: int
    version: int
    partitions_rewritten: int = 0  # partition compaction only: partitions whose fragments were merged
    mixed_fragments_split: int = 0  # ... and fragments that held more than one partition
    versions_kept_pinned: int = 0  # old enough to go, kept: an uncommitted stage attempt reads them
    versions_kept_recent: int = 0  # kept: superseded less than the retention ago


def compact_table(uri: str, target_rows_per_fragment: int = 1_000_000,
                  cleanup_older_than: timedelta = timedelta(days=7),
                  storage_options: StorageOptions = None, partition_columns: Sequence[str] = (),
                  pinned_versions: Collection[int] = ()) -> CompactionReport:
    """Catch indexes up, merge small fragments (dropping deleted rows), remove old versions.

    Tables replaced per partition name their `partition_columns` and are compacted partition by
    partition (`compact_partitions`), so a fragment never mixes sources; the others go
    through Lance's `compact_files`, indexes first: Lance never merges an indexed fragment with
    an unindexed one (a replaced partition's new fragments), so compaction alone left them apart.
    Cleanup (prx_core.store.retention) removes a version only once the version after it is
    `cleanup_older_than` old (aged from supersession, not creation), never one in
    `pinned_versions` (what uncommitted stage attempts read: `retention.pinned_versions`), the
    latest or a tagged one, nor (no `delete_unverified`) files of in-flight writers younger than 7 days.
    """
    ds = require_table(uri, storage_options)
    before = len(ds.get_fragments())
    catch_up_indexes(ds, [d.name for d in ds.describe_indices()])
    partitions = None
    if partition_columns:
        partitions = compact_partitions(uri, partition_columns, target_rows_per_fragment, storage_options)
        ds = require_table(uri, storage_options)
    else:
        ds = compact_files(ds, uri, target_rows_per_fragment, storage_options)
    cleanup = cleanup_superseded(ds, cleanup_older_than, pinned_versions)
    catch_up_indexes(ds, [d.name for d in ds.describe_indices()])
    return CompactionReport(fragments_before=before, fragments_after=len(ds.get_fragments()),
                            versions_removed=cleanup.removed, bytes_removed=cleanup.bytes_removed,
                            version=ds.version, partitions_rewritten=partitions.partitions if partitions else 0,
                            mixed_fragments_split=partitions.mixed_split if partitions else 0,
                            versions_kept_pinned=len(cleanup.kept_pinned),
                            versions_kept_recent=len(cleanup.kept_recent))


def compact_files(ds: LanceDataset, uri: str, target_rows: int, storage_options: StorageOptions) -> LanceDataset:
    """Lance's `compact_files` with its rewrites on Ray workers: planned here from fragment
    metadata, each task merges a group of small fragments (the rows pass through a worker, never
    the driver), then one commit. The shared tables gain a fragment per batch of appends."""
    import ray
    from lance.optimize import Compaction

    if not ray.is_initialized():  # a library call without Ray (a notebook, a script): in this process
        ds.optimize.compact_files(target_rows_per_fragment=target_rows)
        return ds
    plan = Compaction.plan(ds, options={"target_rows_per_fragment": target_rows})
    if not plan.num_tasks():
        return ds
    calls = ((task, uri, ds.version, storage_options) for task in plan.tasks)
    rewrites = [rewrite for _, rewrite in imap_tasks(_rewrite_fragments, calls)]
    Compaction.commit(ds, rewrites)
    return require_table(uri, storage_options)


def _rewrite_fragments(task: Any, uri: str, version: int, storage_options: StorageOptions) -> Any:
    import lance

    return task.execute(lance.dataset(uri, version=version, storage_options=storage_options or None))
