"""Lance table upkeep: fragment health, compaction with safe version cleanup, and indexes.

Queries stay fast only with few, large fragments (~1M rows) and indexes that cover every
fragment; each partition replace adds small fragments and unindexed rows, which this module
measures and repairs. Pure library: never imports dagster.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from lance import LanceDataset

from prx_core.store.lance_io import StorageOptions, is_commit_conflict, require_table
from prx_core.store.segments import MAX_SEGMENTS, segments_to_merge
from prx_core.store.schemas import (BTREE_COLUMNS, FILTER_COLUMNS, FTS_COLUMNS, PARTITION_COLUMNS, RETIRED_INDEXES,
                                    VECTOR_COLUMNS)

FTS_TYPES = {"inverted", "fts"}
MERGE_ROWS = 10_000_000  # index rows maintenance merges per index at least (the bound may ask for more)
BOUNDED_TYPES = {"btree", "bitmap"}  # kept to MAX_SEGMENTS segments at every catch-up; their merges are cheap
MIN_VECTOR_ROWS = 256  # below this a vector index is not built: a flat scan is as fast


@dataclass(frozen=True)
class FragmentHealth:
    """Fragment layout of a table.

    A fragment is small when it holds fewer than `small_fraction * target_rows` live rows, and
    small fragments count only when there are at least two of them: a single small fragment (a
    table's tail, a whole demo table) cannot be merged with anything, so it is not a problem.
    """

    fragments: int
    rows: int
    small_fragments: int
    small_ratio: float
    target_rows: int
    deleted_rows: int = 0

    @property
    def needs_compaction(self) -> bool:
        return self.small_fragments > 0


def fragment_health(uri: str, target_rows: int = 1_000_000, small_fraction: float = 0.5,
                    storage_options: StorageOptions = None) -> FragmentHealth:
    metas = [f.metadata for f in require_table(uri, storage_options).get_fragments()]
    live = [m.num_rows for m in metas]
    small = sum(1 for n in live if n < small_fraction * target_rows)
    small = small if small >= 2 else 0
    return FragmentHealth(fragments=len(metas), rows=sum(live), small_fragments=small,
                          small_ratio=small / len(metas) if metas else 0.0, target_rows=target_rows,
                          deleted_rows=sum(m.num_deletions for m in metas))


@dataclass(frozen=True)
class IndexReport:
    """What `refresh_indexes` did; `indexes` are the names present afterwards, `version` the
    table version after it (what readers of the table see)."""

    indexes: list[str]
    created: list[str]
    optimized: list[str]
    notes: list[str]
    version: int | None = None


def _unindexed_fragments(ds: LanceDataset, desc: Any) -> set[int]:
    covered = {int(i) for segment in desc.segments for i in segment.fragment_ids}
    return {f.fragment_id for f in ds.get_fragments()} - covered


def catch_up_indexes(ds: LanceDataset, names: list[str], merge_rows: int = MERGE_ROWS,
                     max_segments: int = MAX_SEGMENTS) -> list[str]:
    """Index unindexed fragments and merge the newest segments of each index; the indexes done.
    No commit when nothing is stale.

    BTREE and BITMAP indexes (key and partition lookups read every segment) are kept to
    `max_segments` segments whatever the table's history (prx_core.store.segments: size-ratio
    merges of the newest segments, so a row is rewritten a few times, not at every catch-up), and
    fold at least the newest segments within `merge_rows` (0 in the stages' catch-ups).
    Full-text and vector indexes (searches read every segment too) get the same bound in
    maintenance's catch-ups (`merge_rows` > 0: compaction, on a worker), where the rare merge
    that folds the oldest segment belongs; in the stages' (`merge_rows=0`) their new fragments
    get a delta segment of their own, so a commit never waits on a big merge, and the next
    maintenance folds them."""
    rows = {f.fragment_id: f.metadata.num_rows for f in ds.get_fragments()}
    done = []
    for desc in ds.describe_indices():
        if desc.name not in names:
            continue
        segments = [s.fragment_ids for s in desc.segments]
        unindexed = _unindexed_fragments(ds, desc)
        if desc.index_type.lower() in BOUNDED_TYPES or merge_rows > 0:
            # and, where a budget is given (compaction's catch-ups), the newest segments within it:
            # Lance never merges fragments indexed by different segments of an index, so a small
            # delta left by the ratio rule would keep its fragments apart from the older ones
            sizes = [sum(rows.get(i, 0) for i in ids) for ids in segments]
            newest = max(segments_to_merge(sizes, sum(rows[i] for i in unindexed), max_segments),
                         mergeable_segments(segments, rows, merge_rows))
        else:
            newest = mergeable_segments(segments, rows, merge_rows)
        if newest >= 2 or unindexed:
            ds.optimize.optimize_indices(index_names=[desc.name], num_indices_to_merge=newest)
            done.append(desc.name)
    return done


def mergeable_segments(segments: Sequence[Collection[int]], rows: dict[int, int], budget: int) -> int:
    """How many of the newest segments (listed oldest first) fit `budget` rows together."""
    total = count = 0
    for fragment_ids in reversed(segments):
        total += sum(rows.get(i, 0) for i in fragment_ids)
        if total > budget:
            break
        count += 1
    return count


def _find_index(ds: LanceDataset, column: str, kinds: set[str] | None) -> Any | None:
    for desc in ds.describe_indices():
        if list(desc.field_names) == [column] and (kinds is None or desc.index_type.lower() in kinds):
            return desc
    return None


def _create_vector_index(ds: LanceDataset, column: str, rows: int, metric: str, pq_min_rows: int) -> str:
    """IVF with ~sqrt(rows) partitions: IVF_FLAT (exact within partitions) for small tables,
    IVF_PQ (dim/8 sub-vectors of 8 bits) once the table is large and the dimension allows it."""
    dim, name = ds.schema.field(column).type.list_size, f"{column}_vector"
    params = {"num_partitions": max(1, min(4096, round(math.sqrt(rows))))}
    kind = "IVF_PQ" if rows >= pq_min_rows and dim % 8 == 0 else "IVF_FLAT"
    if kind == "IVF_PQ":
        params["num_sub_vectors"] = dim // 8
    ds.create_index(column, kind, name=name, metric=metric, **params)
    return name


def refresh_indexes(uri: str, fts_columns: Sequence[str] = (), vector_column: str | None = None,
                    storage_options: StorageOptions = None, *, bitmap_columns: Sequence[str] = (),
                    btree_columns: Sequence[str] = (),
                    metric: str = "cosine", min_vector_rows: int = MIN_VECTOR_ROWS,
                    pq_min_rows: int = 100_000, merge_rows: int = MERGE_ROWS) -> IndexReport:
    """Create missing INVERTED (full-text), BITMAP (low-cardinality filters), BTREE (key lookups)
    and vector indexes, extend existing ones.

    Idempotent: nothing is committed when every fragment is already indexed and no segments are
    left to merge (`catch_up_indexes`). The vector column
    must be `fixed_size_list<float>` (source embeddings are variable-length lists: cast them to a
    fixed size first); below `min_vector_rows` rows the vector index is skipped with a note.
    """
    ds = require_table(uri, storage_options)
    created: list[str] = []
    existing: list[str] = []
    notes: list[str] = []
    rows = ds.count_rows()
    for columns, kind, kinds, suffix in ((fts_columns, "INVERTED", FTS_TYPES, "fts"),
                                         (bitmap_columns, "BITMAP", {"bitmap"}, "bitmap"),
                                         (btree_columns, "BTREE", {"btree"}, "btree")):
        for column in columns:
            if (desc := _find_index(ds, column, kinds)) is not None:
                existing.append(desc.name)
            elif rows == 0:
                notes.append(f"{column}: no {kind} index on an empty table")
            else:
                ds.create_scalar_index(column, kind, name=f"{column}_{suffix}")
                created.append(f"{column}_{suffix}")
    if vector_column is not None:
        kind = ds.schema.field(vector_column).type
        if not (pa.types.is_fixed_size_list(kind) and pa.types.is_floating(kind.value_type)):
            raise ValueError(f"{uri}: a vector index needs fixed_size_list<float>, {vector_column} is {kind}")
        if (desc := _find_index(ds, vector_column, None)) is not None:
            existing.append(desc.name)
        elif rows < min_vector_rows:
            notes.append(f"{vector_column}: vector index skipped, {rows} rows < {min_vector_rows}")
        else:
            created.append(_create_vector_index(ds, vector_column, rows, metric, pq_min_rows))
    optimized = catch_up_indexes(ds, existing, merge_rows)
    latest = require_table(uri, storage_options)
    names = sorted(d.name for d in latest.describe_indices())
    return IndexReport(indexes=names, created=created, optimized=optimized, notes=notes, version=latest.version)


def drop_retired_indexes(uri: str, table: str, storage_options: StorageOptions = None) -> list[str]:
    """Drop the indexes `table` no longer keeps (schemas.RETIRED_INDEXES) where an older corpus has them."""
    retired = set(RETIRED_INDEXES.get(table, ()))
    if not retired:
        return []
    ds = require_table(uri, storage_options)
    dropped = sorted(retired & {d.name for d in ds.describe_indices()})
    for name in dropped:
        ds.drop_index(name)
    return dropped


def refresh_table_indexes(uri: str, table: str, storage_options: StorageOptions = None,
                          merge_rows: int = 0) -> IndexReport:
    """Every index `table` keeps (prx_core.store.schemas: full-text, vector, BITMAP on its partition
    columns), new fragments indexed: BTREE and BITMAP indexes stay within MAX_SEGMENTS segments
    (prx_core.store.segments), the others gain a delta segment; compact_corpus merges up to `merge_rows`.
    Indexes only speed reads up, so losing a commit race to a concurrent writer is a note, not a
    failed materialization: the next write or compaction catches them up."""
    try:
        drop_retired_indexes(uri, table, storage_options)
        return refresh_indexes(uri, FTS_COLUMNS.get(table, ()), VECTOR_COLUMNS.get(table), storage_options,
                               bitmap_columns=[*PARTITION_COLUMNS.get(table, ()), *FILTER_COLUMNS.get(table, ())],
                               btree_columns=BTREE_COLUMNS.get(table, ()), merge_rows=merge_rows)
    except OSError as exc:  # CommitConflictError is one
        if not is_commit_conflict(exc):
            raise
        version = require_table(uri, storage_options).version
        return IndexReport([], [], [], [f"index refresh lost a commit race, caught up later: {exc}"[:300]], version)


@dataclass(frozen=True)
class VectorIndexCoverage:
    """How much of a table its vector index on `column` covers; what the explorer's fast
    nearest-neighbour search needs (unindexed fragments are searched by a flat scan)."""

    rows: int
    fragments: int
    index: str | None
    unindexed_fragments: list[int]
    min_rows: int

    @property
    def complete(self) -> bool:
        """Every fragment indexed, or the table still below the index threshold."""
        return self.rows < self.min_rows or (self.index is not None and not self.unindexed_fragments)

    @property
    def note(self) -> str:
        if self.rows < self.min_rows:
            return f"{self.rows} rows < {self.min_rows}: no vector index needed yet"
        if self.index is None:
            return f"{self.rows} rows and no vector index"
        if self.unindexed_fragments:
            return f"{self.index}: {len(self.unindexed_fragments)} of {self.fragments} fragments unindexed"
        return f"{self.index} covers all {self.fragments} fragments"


def vector_index_coverage(uri: str, column: str, storage_options: StorageOptions = None,
                          min_rows: int = MIN_VECTOR_ROWS) -> VectorIndexCoverage:
    ds = require_table(uri, storage_options)
    desc = _find_index(ds, column, None)
    unindexed = sorted(_unindexed_fragments(ds, desc)) if desc is not None else [f.fragment_id for f in ds.get_fragments()]
    return VectorIndexCoverage(rows=ds.count_rows(), fragments=len(ds.get_fragments()),
                               index=None if desc is None else desc.name, unindexed_fragments=unindexed,
                               min_rows=min_rows)
