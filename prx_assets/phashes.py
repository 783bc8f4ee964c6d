"""Asset `phashes`: the 64-bit DCT perceptual hash of every sample of a source."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, catalog_source, lance_versions, units_metadata
from prx_core.stages.entry import Progress
from prx_core.stages.phashes import PhashesReport
from prx_resources import CatalogResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage


@dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["samples"], kinds={"ray", "lance"}, code_version="1")
def phashes(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource, ray: RayResource,
            units: UnitsResource) -> dg.MaterializeResult:
    """Hashes from a DCT-scaled decode; feeds the global `duplicates`."""
    source = catalog_source(context, catalog).name
    report: PhashesReport = run_stage(context, ray, "phashes", source=source, storage=storage.storage(),
                                      max_pixels=storage.max_pixels, progress=Progress(f"phashes[{source}]"),
                                      unit_rows=units.phashes_rows)
    return dg.MaterializeResult(
        metadata={"rows": report.rows, "failed": report.failed, "images_per_second": round(report.images_per_second, 1),
                  **units_metadata(report.units),
                  **lance_versions(samples=report.samples_version, phashes=report.phashes_version)},
        data_version=dg.DataVersion(f"phashes@{report.phashes_version}"),
    )
