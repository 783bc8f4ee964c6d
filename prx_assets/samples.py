"""Asset `samples` (+ `rejects`): the unified Lance table of one source's images."""


import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    counts_table,
    dataset_metadata,
    per_second,
    rate,
    size_metadata,
    source_check,
    stage_metadata,
)
from prx_assets.rate_checks import rate_check, rate_description
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.entry import Progress
from prx_core.stages.samples.stage import IngestReport, SourceRefused
from prx_resources import CaptionerResource, CatalogResource, ExplorerResource, StorageResource, UnitsResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

SMALL_FRAGMENT_BUDGET = 16  # below this many small fragments, compaction would not change query speed much
CHECKS = [
    source_check("samples_unique_sample_ids", "samples", blocking=True,
                 description=rate_description("samples_unique_sample_ids",
                                              "Rows whose sample_id repeats another row's (below the threshold "
                                              "they move to rejects as duplicate_key).")),
    source_check("samples_fragment_health", "samples",
                 description=f"Few, large Lance fragments: warns above {SMALL_FRAGMENT_BUDGET} small ones (run compact_corpus)."),
    source_check("samples_reject_reasons", "samples",
                 description="The partition's rejects by reason; warns when more than half were refused."),
]
DESCRIPTION = ("One row per source image in the unified Lance table `samples`: ids, the source bytes, upright size, "
               "format, JPEG quality, caption, embedding. Every image is decoded once (DCT-scaled); bad input is "
               "refused into `rejects` with a reason; source captions are cleaned and capped "
               "(captioner.max_caption_chars); the source's rows are replaced in one commit.")


class SamplesConfig(dg.Config):
    allow_empty: bool = Field(default=False, description=(
        "Let a source that yields no sample succeed: replace a partition holding rows (empty it on purpose), or "
        "keep a source whose every sample is refused; without it such a run fails with one line saying why (the "
        "dominant reject reason, an example and the fix), and a partition holding samples is never replaced."))


def samples_asset(settings: StorageResource, captions: CaptionerResource | None = None) -> dg.AssetsDefinition:
    caption_cap = (captions or CaptionerResource()).caption_cap_version()  # "2-": source captions are cleaned

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("samples", settings.pixel_cap_version(), caption_cap), description=DESCRIPTION,
              owners=OWNERS)
    def samples(
        context: dg.AssetExecutionContext, config: SamplesConfig, catalog: CatalogResource, storage: StorageResource,
        ray: RayResource,
        explorer: ExplorerResource, units: UnitsResource, captioner: CaptionerResource, checks: ChecksResource,
    ) -> dg.MaterializeResult:
        spec = catalog_source(context, catalog)
        try:
            ingest: IngestReport = run_stage(
                context, ray, "samples", spec=spec, storage=storage.storage(), max_pixels=storage.max_pixels,
                progress=Progress(f"samples[{spec.name}]"), **units.settings("samples"),
                max_caption_chars=captioner.max_caption_chars,
                allow_empty=config.allow_empty, max_duplicate_rate=checks.max_rate("samples_unique_sample_ids"))
        except SourceRefused as exc:  # the one line saying why, as the run's failure; a retry would refuse again
            raise dg.Failure(description=str(exc), allow_retries=False) from exc
        report, keys, health = ingest.samples, ingest.keys, ingest.health
        total = report.rows + report.rejected
        checks = [
            rate_check("samples_unique_sample_ids", checks, checked=keys.rows, failed=keys.duplicate_rows,
                       offenders=keys.offenders, rows=keys.rows, distinct=keys.rows - keys.duplicate_rows,
                       moved_to_rejects=keys.duplicate_rows if keys.resolved else 0),
            dg.AssetCheckResult(check_name="samples_fragment_health", passed=health.small_fragments <= SMALL_FRAGMENT_BUDGET,
                                severity=dg.AssetCheckSeverity.WARN,
                                metadata={"fragments": health.fragments, "rows": health.rows,
                                          "small_fragments": health.small_fragments, "small_ratio": health.small_ratio}),
            dg.AssetCheckResult(check_name="samples_reject_reasons", passed=report.rejected <= total / 2,
                                severity=dg.AssetCheckSeverity.WARN,
                                metadata={"rejects": report.rejected, "reasons": counts_table(report.reasons, "reason", total)}),
        ]
        store = storage.storage()
        return dg.MaterializeResult(
            metadata={
                "rows": report.rows, "rejects": report.rejected, "reject_rate": rate(report.rejected, total),
                **size_metadata(report.bytes), "images_per_second": per_second(report.images_per_second),
                "captions_cleaned": report.captions_cleaned, "captions_truncated": report.captions_truncated,
                "reject_reasons": counts_table(report.reasons, "reason", total),
                "rejected_files": dg.MetadataValue.json(ingest.rejected_files),
                **dataset_metadata(store, report.rows, table="samples"),
                **stage_metadata(ingest, fragments_read=report.fragments_read),
                **explorer.metadata(spec.name),
            },
            check_results=checks,
            # rows are a function of the source (raw_source's version), the code and these counts
            data_version=content_version(context, rows=report.rows, rejects=report.rejected, bytes=report.bytes,
                                         reasons=report.reasons, duplicates_moved=keys.duplicate_rows),
        )

    return samples
