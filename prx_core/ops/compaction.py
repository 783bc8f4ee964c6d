"""The whole corpus compacted in one call: what the nightly `compact_corpus` Dagster job runs, and
`prx-corpus compact` without a Dagster instance.

Per table, on a Ray worker (`maintain_table`, prx_core.upkeep.compaction): fragments merged per
partition, versions superseded longer than the retention ago and pinned by no uncommitted stage
attempt cleaned up, index segments merged. Then the MDS chunks no published index has referenced
for the retention, and the tier manifests superseded for it, are removed. It lives on the ops floor
because it spans the store (Lance tables) and the shards (MDS streams, manifests). Ray must be up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prx_core.compute.parallel import run_on_worker
from prx_core.shards.manifest_publish import prune_tier_manifests
from prx_core.shards.mds.retention import RETENTION_SECONDS, PruneReport, prune_streams
from prx_core.store import lance_io
from prx_core.store.maintenance import IndexReport
from prx_core.store.retention import pinned_versions
from prx_core.store.schemas import TABLES
from prx_core.store.storage import Storage
from prx_core.upkeep.compaction import CompactionReport, maintain_table


@dataclass(frozen=True)
class TableMaintenance:
    """One table's compaction and index catch-up."""

    table: str
    compaction: CompactionReport
    indexes: IndexReport

    def line(self) -> str:
        return f"{self.table}: {self.compaction}; indexes: {self.indexes}"


@dataclass(frozen=True)
class CorpusCompaction:
    """What `maintain_corpus` did: each existing table, the MDS chunks and the tier manifests removed."""

    tables: list[TableMaintenance] = field(default_factory=list)
    streams: PruneReport = field(default_factory=PruneReport)
    manifests: list[str] = field(default_factory=list)

    def pruned_lines(self) -> list[str]:
        """What was removed beside the tables: the MDS chunks, then the tier manifests."""
        return [f"mds: {self.streams.streams} streams, {len(self.streams.removed)} superseded chunks removed, "
                f"{self.streams.kept_recent} kept within the retention",
                f"manifests: {len(self.manifests)} superseded tier manifests removed"]


def maintain_corpus(storage: Storage, retention_seconds: float = RETENTION_SECONDS,
                    on_table: Callable[[TableMaintenance], None] | None = None) -> CorpusCompaction:
    """Compact every table of the corpus that exists, then prune superseded MDS chunks and tier
    manifests older than `retention_seconds`. `on_table` hears of each table as it is done (a
    Dagster op logs and observes it there), so a long night shows progress before the end."""
    options = storage.lance_storage_options()
    pins = pinned_versions(storage)  # versions uncommitted stage attempts read: never cleaned up
    tables = []
    for table in TABLES:
        uri = storage.lance_uri(table)
        if not lance_io.table_exists(uri, options):
            continue
        report, indexes = run_on_worker(maintain_table, uri, table, options, pins.get(table, ()), num_cpus=0)
        tables.append(done := TableMaintenance(table, report, indexes))
        if on_table is not None:
            on_table(done)
    streams = prune_streams(storage.root, retention_seconds, storage.storage_options)
    manifests = prune_tier_manifests(storage.root, retention_seconds, storage.storage_options)
    return CorpusCompaction(tables, streams, manifests)
