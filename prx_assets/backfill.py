"""Per-source backfills in two runs, so that a run waiting for the GPU never holds a run slot.

Dagster's run queue with `granularity: op` pools (dagster.yaml) keeps a run queued while the
pools of all its root steps are full, but a run it has started holds one of `max_concurrent_runs`
slots while a later step waits for its pool. A run of the whole chain per source does its CPU
stages, then waits at `captions` for the one `gpu` slot holding a run slot: in a backfill over
300 sources with 4 slots, three sit idle behind the GPU and no other source's CPU stages run.

So a backfill launches `ingest_source` (raw_source to phashes, CPU only) per source, and when one
succeeds `caption_after_ingest` queues `caption_source` for its partition (captions,
caption_labels, caption_embeddings, mds_shards): its one root step is `captions`, in the `gpu`
pool, so the queue holds it until the pool has a slot, and CPU runs of other sources go ahead.
The weekly refresh does the same through the `prx/then` tag of its runs.
"""

from __future__ import annotations

import dagster as dg
from dagster._core.storage.tags import PARTITION_NAME_TAG

from prx_assets.automation import refresh_source_job
from prx_assets.settings import CPU_STAGES, GPU_CHAIN, THEN_TAG

ingest_source_job = dg.define_asset_job(
    "ingest_source", selection=dg.AssetSelection.assets(*CPU_STAGES), executor_def=dg.in_process_executor,
    tags={THEN_TAG: ",".join(GPU_CHAIN)},
    description="The CPU stages of one source (raw_source to phashes); on success caption_source is queued for it. "
                "Backfill this job over many sources: its runs never wait for the GPU while holding a run slot.",
)
caption_source_job = dg.define_asset_job(
    "caption_source", selection=dg.AssetSelection.assets(*GPU_CHAIN), executor_def=dg.in_process_executor,
    description="captions (pool gpu), then caption_labels, caption_embeddings and mds_shards of one source. Its root "
                "step is captions, so the queue holds it, without a run slot, until the gpu pool has one.",
)


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[ingest_source_job, refresh_source_job],
                      request_job=caption_source_job, default_status=dg.DefaultSensorStatus.RUNNING,
                      minimum_interval_seconds=30, name="caption_after_ingest",
                      description="Queues caption_source for a source once its CPU run (ingest_source, or a "
                                  "scheduled refresh_source) succeeded: the GPU chain named in its prx/then tag.")
def caption_after_ingest(context: dg.RunStatusSensorContext) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    then = [a for a in run.tags.get(THEN_TAG, "").split(",") if a]
    partition = run.tags.get(PARTITION_NAME_TAG)
    if not then or partition is None:
        return dg.SkipReason(f"run {run.run_id} asked for nothing after it ({THEN_TAG} tag empty or no partition)")
    unknown = sorted(set(then) - set(GPU_CHAIN))
    if unknown:
        return dg.SkipReason(f"run {run.run_id}: {THEN_TAG} names {unknown}, not of {GPU_CHAIN}")
    return dg.RunRequest(run_key=f"after-{run.run_id}", partition_key=partition,
                         asset_selection=[dg.AssetKey(a) for a in then], tags={"prx/after": run.run_id})
