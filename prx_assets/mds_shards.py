"""Asset `mds_shards`: the source's MDS streams, read back and verified before anyone trains."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    counts_table,
    dataset_metadata,
    human_bytes,
    md_table,
    mds_schema,
    per_second,
    size_metadata,
    source_check,
    stage_metadata,
)
from prx_assets.versions import streams_version
from prx_assets.declared import from_stage
from prx_core.shards.mds.merged import merged_sizes
from prx_core.stages.entry import Progress
from prx_core.stages.mds_shards.report import PublishReport
from prx_resources import (
    CaptionerResource,
    CatalogResource,
    StorageResource,
    TextLatentsResource,
    TrainingResource,
    UnitsResource,
)
from prx_resources.ray import run_stage

CHECKS = [
    source_check(
        "mds_shards_readable", "mds_shards", blocking=True,
        description="Streams read back with mosaicml-streaming, one worker task per shard: per-stream counts equal "
                    "the bucketed rows, xxh64 hashes valid, stored JPEG bytes byte-identical to the encode, quality 92, "
                    "bucket-sized. Exact, no threshold: samples the writer refuses (no_caption, undecodable) are "
                    "rejects before this point, so a mismatch here is a broken write a trainer would read."),
    source_check(
        "mds_shards_stream_sizes", "mds_shards",
        description="Warns about streams smaller than the global batch size x canonical nodes: the PRX trainer's "
                    "per_stream batching raises on such a stream (leave it out of the mixture, lower the batch size, "
                    "or set training.small_streams: drop so mds_shards does not publish it, or merge to join such streams "
                    "across sources; a merged stream still below the minimum is warned about too)."),
]
DESCRIPTION = ("The source's Mosaic Data Shards under `<root>/mds/<source>/<tier>/<w>x<h>`, one stream per bucket, "
               "sorted by `sample_id`, written in content-named chunks and published atomically, plus their `mds_index` "
               "rows; read back and verified before anyone trains. Never automatic: rewriting shards is expensive, "
               "skip-lists absorb policy changes.")


def small_streams_text(small: list[str], streams: int, minimum: int, policy: str) -> str:
    """What the check found (first sentence, per source), then why it matters and what to do."""
    shown = ", ".join(small[:4]) + (", ..." if len(small) > 4 else "")
    return (f"{len(small)} of {streams} streams hold fewer than {minimum} samples, one global batch ({shown}). "
            "The trainer's per_stream batching raises on such a stream, so a trainer must leave it out. Fix: "
            f"training.small_streams: merge (joins them across sources) or drop (now: {policy}), or a smaller "
            "training.global_batch_size; expected on a small corpus such as the demo.")


def mds_shards_asset(settings: StorageResource, captioner: CaptionerResource, training: TrainingResource,
                     latents: TextLatentsResource) -> dg.AssetsDefinition:
    minimum = training.min_stream_samples()
    drop = [f"{training.small_streams}{minimum}"] if minimum else []  # what is published
    stored = [f"latents{latents.version()}"] if latents.enabled else []  # samples carry text latents
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "mds"},
              description=DESCRIPTION, owners=OWNERS,
              **from_stage("mds_shards", settings.tier_version(), settings.pixel_cap_version(),
                           captioner.config().version(), *drop, *stored))
    def mds_shards(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, ray: RayResource, units: UnitsResource, training: TrainingResource,
        text_latents: TextLatentsResource,
    ) -> dg.MaterializeResult:
        source = catalog_source(context, catalog).name
        store, latents = storage.storage(), text_latents.mds_settings()  # mds_settings fingerprints the checkpoint
        published: PublishReport = run_stage(
            context, ray, "mds_shards", source=source, storage=store,
            captioner_version=captioner.config().version(), max_tier=storage.max_tier, max_pixels=storage.max_pixels,
            progress=Progress(f"mds_shards[{source}]", unit="chunks"), min_stream_samples=training.min_stream_samples(),
            merge_small=training.merge_small(),
            latents=latents, **units.settings("mds_shards"))
        report, verified = published.mds, published.verified
        rows, problems = [], list(verified.problems)
        for stream, count in zip(report.streams, published.expectations):
            read = verified.counts.get(stream.uri, 0)
            if read != count.expected:
                problems.append(f"{count.name}: {read} samples read back, {count.expected} expected")
            if count.bucketed is not None and count.bucketed != stream.samples + stream.rejected:
                problems.append(f"{count.name}: {count.bucketed} rows in `buckets`, {stream.samples + stream.rejected} "
                                "routed (is `buckets` older than `samples`?)")
            rows.append({"stream": count.name, "samples": read, "expected": count.expected, "chunks": len(stream.chunks),
                         "shards": stream.shards, "size": human_bytes(stream.bytes), "ok": read == count.expected})
        minimum = training.stream_minimum()
        small = [s.name for s in report.streams if s.samples < minimum and not s.merged]
        merged = merged_sizes(store.root, [(s.tier, s.width, s.height) for s in report.streams if s.merged],
                              store.storage_options)
        small += [name for name, count in merged.items() if count < minimum]  # too few small streams to fill one
        return dg.MaterializeResult(
            metadata={"samples_written": report.written, "streams": len(report.streams),
                      "images_per_second": per_second(report.images_per_second),
                      **size_metadata(sum(s.bytes for s in report.streams)), "stream_table": md_table(rows[:200]),
                      "rejects": counts_table(report.rejects, "reason"), "shards_verified": verified.shards,
                      "streams_below_batch": dg.MetadataValue.json(small),
                      "streams_dropped": dg.MetadataValue.json(report.dropped),  # training.small_streams: drop
                      "streams_merged": dg.MetadataValue.json(report.merged),  # merge: in mds/_merged/<stream>
                      **dataset_metadata(store, sum(s.samples for s in report.streams), uri=store.uri("mds", source),
                                         schema=mds_schema(latents)),
                      **stage_metadata(published)},
            check_results=[
                dg.AssetCheckResult(check_name="mds_shards_readable", passed=not problems,
                                    metadata={"streams": len(rows), "shards": verified.shards,
                                              "problems": "\n".join(problems[:50]) or "none"}),
                dg.AssetCheckResult(check_name="mds_shards_stream_sizes", passed=not small,
                                    severity=dg.AssetCheckSeverity.WARN, description=small_streams_text(
                                        small, len(report.streams), minimum, training.small_streams) if small else None,
                                    metadata={"global_batch_size": training.global_batch_size,
                                              "canonical_nodes": training.canonical_nodes,
                                              "policy": training.small_streams,
                                              "streams_below": dg.MetadataValue.json(small),
                                              "streams_dropped": dg.MetadataValue.json(report.dropped),
                                              "merged_streams": dg.MetadataValue.json(merged)}),
            ],
            # a digest of the bytes a trainer reads: every stream's chunk names, which are content-addressed
            data_version=streams_version(report.streams),
        )

    return mds_shards
