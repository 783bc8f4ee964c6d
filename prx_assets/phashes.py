"""Asset `phashes`: the 64-bit DCT perceptual hash of every sample of a source."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, lance_versions, progress
from prx_core.stages.phashes import build_phashes
from prx_resources import StorageResource


@dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["samples"], kinds={"ray", "lance"}, code_version="1")
def phashes(context: dg.AssetExecutionContext, storage: StorageResource, ray: RayResource) -> dg.MaterializeResult:
    """Hashes from a DCT-scaled decode; feeds the global `duplicates`."""
    report = build_phashes(context.partition_key, storage.storage(), storage.max_pixels, progress(context, f"phashes[{context.partition_key}] chunks"))
    return dg.MaterializeResult(
        metadata={"rows": report.rows, "failed": report.failed, "images_per_second": round(report.images_per_second, 1),
                  **lance_versions(samples=report.samples_version, phashes=report.phashes_version)},
        data_version=dg.DataVersion(f"phashes@{report.phashes_version}"),
    )
