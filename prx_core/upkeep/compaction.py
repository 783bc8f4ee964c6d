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

from prx_core.compute.parallel import TaskFailed, imap_tasks, on_cluster
from prx_core.store.maintenance import MERGE_ROWS, IndexReport, catch_up_indexes, refresh_table_indexes
from prx_core.store.retention import cleanup_superseded
from prx_core.store.schemas import PARTITION_COLUMNS
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


TARGET_BYTES = 64 << 30  # what one ingest unit writes (stages.samples.units.UNIT_BYTES): under Lance's 90 GiB file cap
GROUP_SECONDS = 2 * 3600  # time limit of one group's rewrite: a stuck one is left for the next night
KEY_TASK_FRAGMENTS = 64  # fragments whose partition keys one planning task reads


@dataclass(frozen=True)
class PartitionCompaction:
    """What `compact_partitions` rewrote: fragments removed and written, partitions touched."""

    removed: int
    written: int
    partitions: int
    mixed_split: int  # fragments that held rows of more than one partition
    version: int
    groups: int = 0  # rewrite tasks: groups of fragments of one partition, each at most a target fragment
    groups_failed: int = 0  # groups whose rewrite failed or ran past GROUP_SECONDS: left as they were


def fragment_bytes(fragment: Any) -> int:
    """Bytes of a fragment's data files, from the manifest (0 for a file written without its size)."""
    return sum(int(f.file_size_bytes or 0) for f in fragment.data_files())


def plan_compaction(ds: LanceDataset, columns: Sequence[str], target_rows: int, small_fraction: float = 0.5,
                    deleted_fraction: float = 0.1, target_bytes: int = TARGET_BYTES,
                    storage_options: StorageOptions = None) -> tuple[dict[Key, list[list[int]]], int]:
    """Groups of fragment ids to rewrite per partition key, and how many fragments mix partitions.

    A fragment is small below `small_fraction` of the target in rows AND in bytes: a fragment of
    image blobs reaches the byte target long before a million rows, and rewriting it for its row
    count would rewrite a whole source every night for nothing. A partition is rewritten when it
    has two or more small fragments, a fragment with more than `deleted_fraction` of its rows
    deleted (Lance's own threshold), or rows in a mixed fragment; a lone healthy fragment is left
    alone. Its fragments are cut into groups of at most one target fragment (rows and bytes), each
    one rewrite task, so no task rewrites a whole partition."""
    metas = {f.fragment_id: f.metadata for f in ds.get_fragments()}
    keys_of = partition_keys_of(ds, list(metas), columns, storage_options)
    pure: dict[Key, list[int]] = defaultdict(list)  # fragments holding one partition, by partition
    shared: dict[Key, list[int]] = defaultdict(list)  # fragments mixing it with others
    for fragment_id, keys in keys_of.items():
        for key in keys:
            (pure if len(keys) == 1 else shared)[key].append(fragment_id)
    plan: dict[Key, list[list[int]]] = {}
    for key in pure.keys() | shared.keys():
        small = [i for i in pure[key] if metas[i].num_rows < small_fraction * target_rows
                 and fragment_bytes(metas[i]) < small_fraction * target_bytes]
        deleted = [i for i in pure[key]
                   if metas[i].num_deletions > deleted_fraction * (metas[i].num_rows + metas[i].num_deletions)]
        if len(small) >= 2 or deleted or shared[key]:
            groups = group_fragments(sorted(set(small) | set(deleted) | set(shared[key])), metas, target_rows,
                                     target_bytes)
            # a lone small fragment, healthy otherwise, gains nothing from a rewrite of its own
            plan[key] = [g for g in groups if len(g) > 1 or set(g) & (set(deleted) | set(shared[key]))]
            if not plan[key]:
                del plan[key]
    return plan, sum(1 for keys in keys_of.values() if len(keys) > 1)


def group_fragments(ids: list[int], metas: dict[int, Any], target_rows: int, target_bytes: int) -> list[list[int]]:
    """Consecutive fragments in groups of at most one target fragment (rows and bytes, live rows)."""
    groups: list[list[int]] = []
    rows = size = 0
    for i in ids:
        live, nbytes = metas[i].num_rows, fragment_bytes(metas[i])  # num_rows: the live rows
        if groups and groups[-1] and (rows + live > target_rows or size + nbytes > target_bytes):
            groups.append([])
            rows = size = 0
        if not groups:
            groups.append([])
        groups[-1].append(i)
        rows, size = rows + live, size + nbytes
    return groups


def partition_keys_of(ds: LanceDataset, fragment_ids: list[int], columns: Sequence[str],
                      storage_options: StorageOptions = None, per_task: int = KEY_TASK_FRAGMENTS) -> dict[int, set[Key]]:
    """`fragment_keys` of every fragment: on Ray in tasks of `per_task` fragments of this version,
    else here. A fragment costs two or three small reads, round trips on an object store: thousands
    of fragments one after another took minutes. (Threads of one process are no option: pylance
    14.0.2 deadlocks on concurrent `count_rows` of fragments of one dataset.)"""
    if not on_cluster() or len(fragment_ids) <= per_task:
        return {i: fragment_keys(ds, i, columns) for i in fragment_ids}
    calls = [(ds.uri, ds.version, fragment_ids[k:k + per_task], list(columns), storage_options)
             for k in range(0, len(fragment_ids), per_task)]
    keys: dict[int, set[Key]] = {}
    for _, part in imap_tasks(fragments_keys, calls):
        keys.update(part)
    return keys


def fragments_keys(uri: str, version: int, fragment_ids: list[int], columns: list[str],
                   storage_options: StorageOptions) -> dict[int, set[Key]]:
    """Ray task: `fragment_keys` of these fragments of one version."""
    ds = require_table(uri, storage_options).checkout_version(version)
    return {i: fragment_keys(ds, i, columns) for i in fragment_ids}


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


def rewrite_partition(uri: str, version: int, fragment_ids: list[int], predicate: str | None, target_rows: int,
                      storage_options: StorageOptions, target_bytes: int | None = None) -> list[dict]:
    """Ray task: one partition's rows of the given fragments, rewritten into new fragments of up to
    `target_rows` rows and `target_bytes` (no commit); the rows, image bytes included, never pass
    through the driver."""
    ds = require_table(uri, storage_options).checkout_version(version)
    scanner = ds.scanner(fragments=[ds.get_fragment(i) for i in fragment_ids], filter=predicate)
    written = write_fragments(uri, scanner.to_reader(), ds.schema, storage_options, max_rows_per_file=target_rows,
                              max_bytes_per_file=target_bytes)
    return [f.to_json() for f in written]


def compact_partitions(uri: str, columns: Sequence[str], target_rows: int = 1_000_000,
                       storage_options: StorageOptions = None, max_retries: int = 3,
                       target_bytes: int = TARGET_BYTES, group_seconds: float = GROUP_SECONDS) -> PartitionCompaction:
    """Merge each partition's small fragments, split mixed ones, in one commit; rows unchanged.
    The driver plans from fragment metadata and indexed counts; one Ray task per group of
    fragments rewrites (`plan_compaction`), cancelled after `group_seconds`. A group that fails
    or times out keeps its fragments (the next run tries again); the others commit.

    On a conflict (a partition replace committed meanwhile) the plan is made again from the new
    version; fragments written for the lost attempt are never referenced and go with the
    orphan cleanup of `cleanup_old_versions`."""
    for attempt in range(max_retries + 1):
        ds = require_table(uri, storage_options)
        plan, mixed = plan_compaction(ds, columns, target_rows, target_bytes=target_bytes,
                                      storage_options=storage_options)
        if not plan:
            return PartitionCompaction(0, 0, 0, 0, ds.version)
        groups = [(key, ids) for key, cut in sorted(plan.items(), key=lambda item: repr(item[0])) for ids in cut]
        calls = ((uri, ds.version, ids, partition_predicate(columns, key), target_rows, storage_options, target_bytes)
                 for key, ids in groups)
        done = dict(imap_tasks(rewrite_partition, calls, time_limit_s=group_seconds, yield_failures=True))
        failed = [n for n, written in done.items() if isinstance(written, TaskFailed)]
        for n in failed:
            log.warning("%s: compaction of fragments %s left as they were: %s", uri, groups[n][1], done[n])
        kept = [n for n in range(len(groups)) if n not in failed]
        new = [f for n in kept for f in fragments_from_json(done[n])]
        removed = sorted({i for n in kept for i in groups[n][1]})
        if not removed:
            return PartitionCompaction(0, 0, 0, mixed, ds.version, len(groups), len(failed))
        try:
            op = LanceOperation.Update(removed_fragment_ids=removed, new_fragments=new)
            version = LanceDataset.commit(ds, op, read_version=ds.version).version
        except CommitConflictError as exc:
            log.info("%s: compaction conflicted (attempt %d), planning again: %s", uri, attempt + 1, exc)
            backoff(attempt)
            continue
        partitions = len({repr(groups[n][0]) for n in kept})
        return PartitionCompaction(len(removed), len(new), partitions, mixed, version, len(groups), len(failed))
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
                  pinned_versions: Collection[int] = (), target_bytes: int = TARGET_BYTES) -> CompactionReport:
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
        partitions = compact_partitions(uri, partition_columns, target_rows_per_fragment, storage_options,
                                        target_bytes=target_bytes)
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


def maintain_table(uri: str, table: str, storage_options: StorageOptions, pinned: Collection[int] = (),
                   merge_rows: int = MERGE_ROWS) -> tuple[CompactionReport, IndexReport]:
    """What compact_corpus does to one table: compaction (per partition where the table has
    partition columns), cleanup of versions no stage attempt pins, then its indexes caught up with
    at most `merge_rows` rows of segments merged each. Run it on a worker (`run_on_worker`, no CPU
    of its own: it waits on its rewrite tasks), so no index merge holds the driver's memory."""
    report = compact_table(uri, storage_options=storage_options, partition_columns=PARTITION_COLUMNS.get(table, ()),
                           pinned_versions=pinned)
    return report, refresh_table_indexes(uri, table, storage_options, merge_rows=merge_rows)
