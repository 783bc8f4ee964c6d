"""Partitions kept in sync with the catalog, scheduled per-source refreshes, Lance compaction."""


import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from prx_assets.common import SOURCES
from prx_assets.settings import PER_SOURCE
from prx_core.shards.publish import RETENTION_SECONDS, prune_streams
from prx_core.store import lance_io, maintenance
from prx_core.store.schemas import PARTITION_COLUMNS, TABLES
from prx_resources import CatalogResource, StorageResource

refresh_source_job = dg.define_asset_job(
    "refresh_source", selection=dg.AssetSelection.assets(*PER_SOURCE),
    description="Re-ingest one source end to end; duplicates and skip_lists follow by automation.",
)


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING)
def sources_sensor(context: dg.SensorEvaluationContext, catalog: CatalogResource) -> dg.SensorResult:
    """Adds a partition for every catalog source and removes those no longer listed."""
    current = set(context.instance.get_dynamic_partitions(SOURCES.name))
    wanted = catalog.load().names
    added = [name for name in wanted if name not in current]
    removed = sorted(current - set(wanted))
    requests = ([SOURCES.build_add_request(added)] if added else []) + ([SOURCES.build_delete_request(removed)] if removed else [])
    return dg.SensorResult(dynamic_partitions_requests=requests,
                           skip_reason=None if requests else "catalog and partitions agree")


@dg.schedule(job=refresh_source_job, cron_schedule="0 2 * * 0", default_status=dg.DefaultScheduleStatus.STOPPED)
def weekly_source_refresh(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
    """One run per source partition every week: a scheduled per-source backfill."""
    return [dg.RunRequest(partition_key=name, run_key=f"{name}-{context.scheduled_execution_time:%Y%m%d}")
            for name in context.instance.get_dynamic_partitions(SOURCES.name)]


class CompactConfig(dg.Config):
    mds_retention_hours: float = Field(default=RETENTION_SECONDS / 3600, ge=0,
                                       description="Superseded MDS chunks outlive the index that dropped them by this much: "
                                                   "longer than any training job that may still hold an old index.json.")


@dg.op(description="Per table: merge small fragments (per source for per-source tables), clean versions "
                   "older than the retention, merge index segments; then remove MDS chunks no published "
                   "index references once older than the retention")
def compact_tables(context: dg.OpExecutionContext, storage: StorageResource, ray: RayResource, config: CompactConfig) -> None:
    store = storage.storage()
    options = store.lance_storage_options()
    for table in TABLES:
        uri = store.lance_uri(table)
        if not lance_io.table_exists(uri, options):
            continue
        report = maintenance.compact_table(uri, storage_options=options,
                                                 partition_columns=PARTITION_COLUMNS.get(table, ()))
        indexes = maintenance.refresh_table_indexes(uri, table, options, merge=True)
        context.log.info(f"{table}: {report}; indexes: {indexes}")
        if table in PER_SOURCE + ["duplicates"]:  # rejects, mds_index, source_embeddings are tables, not assets
            context.log_event(dg.AssetObservation(asset_key=table, metadata=dict(report.__dict__)))
    pruned = prune_streams(store.root, config.mds_retention_hours * 3600, store.storage_options)
    context.log.info(f"mds: {pruned.streams} streams, {len(pruned.removed)} superseded chunks removed, "
                     f"{pruned.kept_recent} kept within the retention")


@dg.job(description="Compact every Lance table and clean old versions safely.")
def compact_corpus() -> None:
    compact_tables()


compact_schedule = dg.ScheduleDefinition(job=compact_corpus, cron_schedule="0 4 * * *",
                                         default_status=dg.DefaultScheduleStatus.STOPPED)
