"""Asset `explorer`: the source's rows of the explorer's table and its filter-menu counts."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.conditions import EXPLORER_CONDITION
from prx_assets.common import GROUP, OWNERS, SOURCES, catalog_source, counts_table, dataset_metadata, rate, stage_metadata
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.entry import Progress
from prx_core.stages.explorer.stage import ExplorerReport
from prx_resources import CaptionerResource, CatalogResource, LabelerResource, StorageResource, UnitsResource
from prx_resources.ray import run_stage

DESCRIPTION = ("One row per sample and per ingest reject of the source with what `prx-corpus browse` filters on and "
               "shows (size, reject reason, bucket, pHash group, the shipped caption and label, MDS position, skip "
               "reasons), joined on workers and indexed (BITMAP filters, BTREE keys, full-text captions), plus the "
               "source's filter-menu counts in `explorer_facets`: the explorer reads pages, never whole tables. "
               "Follows its source's upstream changes by automation (another source's runs leave it as it is); a rerun "
               "over unchanged reads of its source writes nothing.")


def explorer_asset(captioner: CaptionerResource, labeler: LabelerResource) -> dg.AssetsDefinition:

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, kinds={"ray", "lance"}, owners=OWNERS,
              **from_stage("explorer", captioner.config().version(), labeler.config().version()),
              automation_condition=EXPLORER_CONDITION, description=DESCRIPTION)
    def explorer(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
                 captioner: CaptionerResource, labeler: LabelerResource, ray: RayResource,
                 units: UnitsResource) -> dg.MaterializeResult:
        source = catalog_source(context, catalog).name
        store = storage.storage()
        report: ExplorerReport = run_stage(context, ray, "explorer", source=source, storage=store,
                                           captioner_version=captioner.config().version(),
                                           labeler_version=labeler.config().version(),
                                           progress=Progress(f"explorer[{source}]"), **units.settings("explorer"))
        shown = {"samples": report.samples, "ingest rejects": report.ingest_rejects, "captioned": report.captioned,
                 "in MDS": report.in_mds, "skipped": report.skipped}
        return dg.MaterializeResult(
            metadata={"rows": report.rows, "samples": report.samples, "ingest_rejects": report.ingest_rejects,
                      "captioned_rate": rate(report.captioned, report.samples), "facet_rows": report.facets,
                      "coverage": counts_table(shown, "rows", report.rows),
                      **dataset_metadata(store, report.rows, table="explorer"),
                      **stage_metadata(report)},
            # what the pages show is a function of the pinned inputs: their versions are the run's content
            data_version=content_version(context, rows=report.rows, captioned=report.captioned, in_mds=report.in_mds,
                                         skipped=report.skipped, explorer=report.explorer_version),
        )

    return explorer
