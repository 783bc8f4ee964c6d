"""Asset `mds_shards`: the source's MDS streams, read back and verified before anyone trains."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, catalog_source, counts_table, lance_versions, md_table, units_metadata
from prx_core.stages.entry import Progress, PublishReport
from prx_resources import CaptionerResource, CatalogResource, StorageResource, TrainingResource, UnitsResource
from prx_resources.ray import run_stage

CHECKS = [
    dg.AssetCheckSpec(
        "mds_shards_readable", asset="mds_shards", blocking=True,
        description="Streams read back with mosaicml-streaming, one worker task per shard: per-stream counts equal "
                    "the bucketed rows, xxh64 hashes valid, stored JPEG bytes byte-identical to the encode, quality 92, "
                    "bucket-sized. Exact, no threshold: samples the writer refuses (no_caption, undecodable) are "
                    "rejects before this point, so a mismatch here is a broken write a trainer would read."),
    dg.AssetCheckSpec(
        "mds_shards_stream_sizes", asset="mds_shards",
        description="Warns about streams smaller than the global batch size: the PRX trainer's per_stream batching "
                    "raises on such a stream (leave it out of the mixture or lower the batch size)."),
]


def mds_shards_asset(settings: StorageResource, captioner: CaptionerResource) -> dg.AssetsDefinition:
    """Never automatic: rewriting shards is expensive; skip-lists absorb policy changes."""

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["buckets", "captions"], check_specs=CHECKS,
              kinds={"ray", "s3"}, code_version=f"2-{settings.tier_version()}-{settings.pixel_cap_version()}-{captioner.config().version()}")
    def mds_shards(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, ray: RayResource, units: UnitsResource, training: TrainingResource,
    ) -> dg.MaterializeResult:
        source = catalog_source(context, catalog).name
        published: PublishReport = run_stage(
            context, ray, "mds_shards", source=source, storage=storage.storage(),
            captioner_version=captioner.config().version(), max_tier=storage.max_tier, max_pixels=storage.max_pixels,
            progress=Progress(f"mds_shards[{source}]", unit="chunks"), route_rows=units.mds_route_rows,
            chunk_rows=units.mds_chunk_rows)
        report, verified, buckets_version = published.mds, published.verified, published.buckets_version
        rows, problems = [], list(verified.problems)
        for stream, count in zip(report.streams, published.expectations):
            read = verified.counts.get(stream.uri, 0)
            if read != count.expected:
                problems.append(f"{count.name}: {read} samples read back, {count.expected} expected")
            if count.bucketed is not None and count.bucketed != stream.samples + stream.rejected:
                problems.append(f"{count.name}: {count.bucketed} rows in `buckets`, {stream.samples + stream.rejected} "
                                "routed (is `buckets` older than `samples`?)")
            rows.append({"stream": count.name, "samples": read, "expected": count.expected, "chunks": len(stream.chunks),
                         "shards": stream.shards, "MB": round(stream.bytes / 1e6, 2), "ok": read == count.expected})
        small = [s.name for s in report.streams if s.samples < training.global_batch_size]
        return dg.MaterializeResult(
            metadata={"samples_written": report.written, "streams": len(report.streams),
                      "images_per_second": round(report.images_per_second, 1),
                      "bytes": sum(s.bytes for s in report.streams), "stream_table": md_table(rows[:200]),
                      "rejects": counts_table(report.rejects, "reason"), "shards_verified": verified.shards,
                      "streams_below_batch": dg.MetadataValue.json(small),
                      **{f"{phase}_{k}": v for phase, r in report.units.items() for k, v in units_metadata(r).items()},
                      **lance_versions(**report.read_versions, buckets=buckets_version, mds_index=report.mds_index_version)},
            check_results=[
                dg.AssetCheckResult(check_name="mds_shards_readable", passed=not problems,
                                    metadata={"streams": len(rows), "shards": verified.shards,
                                              "problems": "\n".join(problems[:50]) or "none"}),
                dg.AssetCheckResult(check_name="mds_shards_stream_sizes", passed=not small,
                                    severity=dg.AssetCheckSeverity.WARN,
                                    metadata={"global_batch_size": training.global_batch_size,
                                              "streams_below": dg.MetadataValue.json(small)}),
            ],
            data_version=dg.DataVersion(f"mds_index@{report.mds_index_version}"),
        )

    return mds_shards

