"""Partitions kept in sync with the catalog, eager assets, named jobs, scheduled refreshes, compaction.

The schedules' cron strings, what a scheduled refresh materializes and whether the automation
condition sensor starts RUNNING come from the `automation` section of PRX_CONFIG
(AutomationSettings); both schedules are STOPPED until an operator starts them.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields

import dagster as dg
from dagster._utils.schedules import is_valid_cron_schedule
from dagster_ray import RayResource
from pydantic import Field

from prx_assets.common import SOURCES
from prx_assets.settings import CPU_STAGES, GPU_CHAIN, PER_SOURCE, THEN_TAG, Settings, SettingsError, load_settings
from prx_core.ops.compaction import TableMaintenance, maintain_corpus
from prx_core.shards.mds.retention import RETENTION_SECONDS
from prx_resources import CatalogResource, StorageResource

# In one process: every step reuses the run's Ray (embedded, or its connection to the cluster) instead
# of importing the definitions and starting or connecting to Ray once per step; the stages are a chain
# and parallel inside Ray, so steps in parallel processes would gain nothing.
refresh_source_job = dg.define_asset_job(
    "refresh_source", selection=dg.AssetSelection.assets(*PER_SOURCE), executor_def=dg.in_process_executor,
    description="Re-ingest one source: the weekly schedule runs its CPU stages, then queues the GPU chain after "
                "them (caption_after_ingest); duplicates and skip_lists follow by automation.",
)
# Named jobs for the Jobs page, so runs launched there say what they are (not `__ASSET_JOB`).
build_source_job = dg.define_asset_job(
    "build_source", selection=dg.AssetSelection.assets(*PER_SOURCE), executor_def=dg.in_process_executor,
    description="Every per-source asset of one source partition (raw_source to mds_shards) in one run: a new source's "
                "first build. For a backfill over many sources use ingest_source (its runs never hold a run slot "
                "waiting for the GPU); the global duplicates and the source's skip_lists follow by automation.",
)
# Unpartitioned: one run recomputes the corpus-wide duplicate groups. skip_lists (per source) is not in it,
# or each run of a backfill over sources would recompute the groups again; it follows by automation (eager).
dedup_corpus_job = dg.define_asset_job(
    "dedup_corpus", selection=dg.AssetSelection.assets("duplicates"), executor_def=dg.in_process_executor,
    description="Recompute the duplicate groups over every source; each source's skip_lists follows by automation.",
)
# Per source, after the global duplicates: what training and the explorer read (both eager, so this job is
# for a manual rerun, e.g. after a skip policy change).
publish_source_job = dg.define_asset_job(
    "publish_source", selection=dg.AssetSelection.assets("skip_lists", "explorer"), executor_def=dg.in_process_executor,
    description="One source's skip_lists and explorer rows, which read the corpus-wide duplicates: run it after "
                "dedup_corpus, or after a skip policy change (both follow by automation otherwise).",
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


@dataclass(frozen=True)
class AutomationSettings:
    """`automation:` in PRX_CONFIG. `refresh_cron` (UTC; default Sundays 02:00) fires
    weekly_source_refresh, one run per source of `refresh_assets` (default: every per-source asset,
    the refresh_source job); `compact_cron` (default 04:00 daily) fires compact_corpus;
    `condition_sensor` is the default status of the sensor running the eager assets (an instance
    keeps a status set in the UI or by `dagster sensor start/stop` over this default);
    `condition_interval_s` the least seconds between its ticks (each evaluates every asset's condition)."""

    refresh_cron: str = "0 2 * * 0"
    refresh_assets: tuple[str, ...] = tuple(PER_SOURCE)
    compact_cron: str = "0 4 * * *"
    condition_sensor: str = "running"  # or "stopped": the automation condition sensor's default status
    condition_interval_s: int = 30


def automation_settings(settings: Settings) -> AutomationSettings:
    """The section checked when the code location loads: a bad cron or asset name is the operator's to fix."""
    section, defaults = settings.section("automation"), AutomationSettings()
    names = [f.name for f in fields(AutomationSettings)]
    if unknown := sorted(set(section) - set(names)):
        raise SettingsError(f"automation: unknown fields {unknown}; expected some of {names}")
    for name in ("refresh_cron", "compact_cron"):
        value = section.get(name, getattr(defaults, name))
        if not isinstance(value, str) or not is_valid_cron_schedule(value):
            raise SettingsError(f"automation.{name}: {value!r} is not a cron string, e.g. {getattr(defaults, name)!r}")
    assets = section.get("refresh_assets", list(defaults.refresh_assets))
    if not isinstance(assets, list) or not assets or not set(assets) <= set(PER_SOURCE):
        raise SettingsError(f"automation.refresh_assets: {assets!r} must be a non-empty list of {PER_SOURCE}")
    sensor = section.get("condition_sensor", defaults.condition_sensor)
    if sensor not in ("running", "stopped"):
        raise SettingsError(f"automation.condition_sensor: {sensor!r} must be running or stopped")
    interval = section.get("condition_interval_s", defaults.condition_interval_s)
    if type(interval) is not int or interval < 1:
        raise SettingsError(f"automation.condition_interval_s: {interval!r} must be a whole number of seconds >= 1")
    return AutomationSettings(refresh_cron=section.get("refresh_cron", defaults.refresh_cron),
                              refresh_assets=tuple(a for a in PER_SOURCE if a in assets),
                              compact_cron=section.get("compact_cron", defaults.compact_cron), condition_sensor=sensor,
                              condition_interval_s=interval)


def condition_sensor(status: str = "running", interval_s: int = 30) -> dg.AutomationConditionSensorDefinition:
    """Evaluates every asset's automation condition, RUNNING by default: without it the eager assets are
    only labels in the UI (Dagster's own default_automation_condition_sensor starts stopped). At most
    one tick per `interval_s` (the daemon's loop adds up to 5 s)."""
    return dg.AutomationConditionSensorDefinition(
        "automation_condition_sensor", target=dg.AssetSelection.all(), minimum_interval_seconds=interval_s,
        default_status=dg.DefaultSensorStatus.RUNNING if status == "running" else dg.DefaultSensorStatus.STOPPED,
        description="Materializes the eager assets (buckets, caption_labels, caption_embeddings, duplicates, "
                    "skip_lists) when what they read changed. Stop it in Automation, or automation.condition_sensor: stopped.")


def refresh_schedule(cron: str, assets: Sequence[str] = PER_SOURCE) -> dg.ScheduleDefinition:
    """weekly_source_refresh on `cron`: per source, a refresh_source run of the CPU stages among
    `assets`, whose success queues the GPU chain among them (prx_assets.backfill); `assets` of
    the GPU chain only: one run of them."""
    cpu, gpu = [a for a in assets if a in CPU_STAGES], [a for a in assets if a in GPU_CHAIN]
    selection = [dg.AssetKey(a) for a in cpu or gpu]
    tags = {THEN_TAG: ",".join(gpu)} if cpu and gpu else {}

    @dg.schedule(name="weekly_source_refresh", job=refresh_source_job, cron_schedule=cron,
                 default_status=dg.DefaultScheduleStatus.STOPPED)
    def weekly_source_refresh(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
        """One run per source partition every week: a scheduled per-source backfill."""
        when = f"{context.scheduled_execution_time:%Y%m%dT%H%M}"  # one run per source and tick
        return [dg.RunRequest(partition_key=name, run_key=f"{name}-{when}", asset_selection=selection, tags=tags)
                for name in context.instance.get_dynamic_partitions(SOURCES.name)]

    return weekly_source_refresh


AUTOMATION = automation_settings(load_settings())
weekly_source_refresh = refresh_schedule(AUTOMATION.refresh_cron, AUTOMATION.refresh_assets)
automation_condition_sensor = condition_sensor(AUTOMATION.condition_sensor, AUTOMATION.condition_interval_s)


class CompactConfig(dg.Config):
    mds_retention_hours: float = Field(default=RETENTION_SECONDS / 3600, ge=0,
                                       description="Superseded MDS chunks outlive the index that dropped them by this much: "
                                                   "longer than any training job that may still hold an old index.json.")


@dg.op(description="Per table: merge small fragments (per source for per-source tables), clean versions "
                   "superseded longer than the retention ago and pinned by no running stage, merge index "
                   "segments; then remove MDS chunks no published index has referenced for the retention, and "
                   "tier manifests superseded for the retention")
def compact_tables(context: dg.OpExecutionContext, storage: StorageResource, ray: RayResource, config: CompactConfig) -> None:
    """prx_core.ops.compaction on the run's Ray; each table logged, and observed when it is an asset's."""

    def observe(done: TableMaintenance) -> None:
        context.log.info(done.line())
        if done.table in PER_SOURCE + ["duplicates"]:  # rejects, mds_index, source_embeddings are tables, not assets
            context.log_event(dg.AssetObservation(asset_key=done.table, metadata=dict(done.compaction.__dict__)))

    result = maintain_corpus(storage.storage(), config.mds_retention_hours * 3600, on_table=observe)
    for line in result.pruned_lines():
        context.log.info(line)


@dg.job(description="Compact every Lance table and clean old versions safely.")
def compact_corpus() -> None:
    compact_tables()


compact_schedule = dg.ScheduleDefinition(job=compact_corpus, cron_schedule=AUTOMATION.compact_cron,
                                         default_status=dg.DefaultScheduleStatus.STOPPED)
