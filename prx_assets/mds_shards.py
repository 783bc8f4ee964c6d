"""Asset `mds_shards`: the source's MDS streams, read back and verified before anyone trains."""


from collections import Counter

import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, counts_table, lance_versions, md_table, progress
from prx_core.shards.mds_read import verify_stream
from prx_core.stages.mds_shards import build_mds
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage
from prx_resources import CaptionerResource, StorageResource

CHECKS = [dg.AssetCheckSpec(
    "mds_shards_readable", asset="mds_shards", blocking=True,
    description="Streams read back with mosaicml-streaming: per-stream counts equal the bucketed rows, xxh64 "
                "hashes valid, stored JPEG bytes byte-identical to the encode, quality 92, bucket-sized.")]


def mds_shards_asset(settings: StorageResource, captioner: CaptionerResource) -> dg.AssetsDefinition:
    """Never automatic: rewriting shards is expensive; skip-lists absorb policy changes."""

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["buckets", "captions"], check_specs=CHECKS,
              kinds={"ray", "s3"}, code_version=f"1-{settings.tier_version()}-{settings.pixel_cap_version()}-{captioner.config().version()}")
    def mds_shards(
        context: dg.AssetExecutionContext, storage: StorageResource, captioner: CaptionerResource, ray: RayResource
    ) -> dg.MaterializeResult:
        source, store = context.partition_key, storage.storage()
        report = build_mds(source, store, captioner.config().version(), storage.max_tier, storage.max_pixels,
                           progress(context, f"mds_shards[{source}] chunks"))
        expected = expected_counts(store, source)
        rows, problems = [], []
        for stream in report.streams:
            name = f"{stream.tier}/{stream.width}x{stream.height}"
            want = expected.pop(name, 0)
            check = verify_stream(stream.uri, store.storage_options, expected_sha256=stream.image_sha256, expected_quality=92)
            problems += [f"{name}: {p}" for p in check.problems]
            if check.count != want:
                problems.append(f"{name}: {check.count} samples read back, {want} bucketed rows")
            rows.append({"stream": name, "samples": check.count, "expected": want, "shards": stream.shards,
                         "MB": round(stream.bytes / 1e6, 2), "ok": check.ok and check.count == want})
        problems += [f"{name}: {n} bucketed rows but no stream" for name, n in expected.items() if n]
        return dg.MaterializeResult(
            metadata={"samples_written": report.written, "streams": len(report.streams),
                      "images_per_second": round(report.images_per_second, 1),
                      "bytes": sum(s.bytes for s in report.streams), "stream_table": md_table(rows),
                      "rejects": counts_table(report.rejects, "reason"),
                      **lance_versions(**report.read_versions, mds_index=report.mds_index_version)},
            check_results=[dg.AssetCheckResult(check_name="mds_shards_readable", passed=not problems,
                                               metadata={"streams": len(rows), "problems": "\n".join(problems[:50]) or "none"})],
            data_version=dg.DataVersion(f"mds_index@{report.mds_index_version}"),
        )

    return mds_shards


def expected_counts(store: Storage, source: str) -> dict[str, int]:
    """Bucketed rows per stream minus those `mds_shards` itself rejected (e.g. no caption)."""
    options = store.lance_storage_options()
    placed = lance_io.read_table(store.lance_uri("buckets"), ["sample_id", "tier", "bucket"],
                                 f"{source_predicate(source)} AND tier IS NOT NULL", options).to_pylist()
    refused = set(lance_io.read_table(store.lance_uri("rejects"), ["sample_id"],
                                      f"{source_predicate(source)} AND stage = 'mds_shards'", options)["sample_id"].to_pylist())
    return dict(Counter(f"{r['tier']}/{r['bucket']}" for r in placed if r["sample_id"] not in refused))
