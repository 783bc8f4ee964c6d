"""Asset `phashes`: the 64-bit DCT perceptual hash of every sample of a source."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    dataset_metadata,
    per_second,
    rate,
    stage_metadata,
)
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.entry import Progress
from prx_core.stages.phashes import PhashesReport
from prx_resources import CatalogResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage

DESCRIPTION = "The 64-bit DCT perceptual hash of every sample, from a DCT-scaled decode; feeds the global `duplicates`."


@dg.asset(partitions_def=SOURCES, group_name=GROUP, kinds={"ray", "lance"}, **from_stage("phashes"),
          description=DESCRIPTION, owners=OWNERS)
def phashes(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource, ray: RayResource,
            units: UnitsResource) -> dg.MaterializeResult:
    source = catalog_source(context, catalog).name
    report: PhashesReport = run_stage(context, ray, "phashes", source=source, storage=storage.storage(),
                                      max_pixels=storage.max_pixels, progress=Progress(f"phashes[{source}]"),
                                      **units.settings("phashes"))
    return dg.MaterializeResult(
        metadata={"rows": report.rows, "failed": report.failed, "failure_rate": rate(report.failed, report.rows + report.failed),
                  "images_per_second": per_second(report.images_per_second),
                  **dataset_metadata(storage.storage(), report.rows, table="phashes"),
                  **stage_metadata(report)},
        # hashes are a function of the samples' pixels: their version, the code, and the counts
        data_version=content_version(context, rows=report.rows, failed=report.failed),
    )
