"""Asset `captions`: VLM re-captioning of eligible samples, each content once per captioner."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import GROUP, SOURCES, catalog_source, counts_table, lance_versions, units_metadata
from prx_assets.rate_checks import rate_check, rate_description
from prx_core.models.captioning import SOURCE_HAS_NONE
from prx_core.stages.captions import CaptionsReport
from prx_core.stages.entry import Progress
from prx_resources import CaptionerResource, CatalogResource, ExplorerResource, StorageResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

COVERAGE = ("Eligible (bucketed) contents of the source the captioner failed on (stored with their error and "
            "retried on the next run); mds_shards refuses them (reject `no_caption`). Under the `source` captioner a "
            "content the source has no caption for is not a failure: it is counted apart (`without_source_caption`) "
            "and refused by mds_shards the same way, and a source with no caption at all fails the captions run.")
CHECKS = [dg.AssetCheckSpec("captions_coverage", asset="captions", blocking=True,
                            description=rate_description("captions_coverage", COVERAGE))]


def captions_asset(captioner: CaptionerResource) -> dg.AssetsDefinition:
    """Never automatic (it is the dominant cost): materialize by hand or by backfill."""

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["buckets"], check_specs=CHECKS, kinds={"ray", "lance"},
              code_version=captioner.config().version(), pool="gpu")
    def captions(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, ray: RayResource, explorer: ExplorerResource, checks: ChecksResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        store, config = storage.storage(), captioner.config()
        report: CaptionsReport = run_stage(context, ray, "captions", source=context.partition_key, storage=store,
                                           config=config, actors=captioner.actors,
                                           progress=Progress(f"captions[{context.partition_key}]"))
        if report.without_source_caption:
            context.log.warning(f"captions[{context.partition_key}]: {report.without_source_caption} of "
                                f"{report.eligible} eligible contents have no source caption; mds_shards refuses "
                                f"them (no_caption): {SOURCE_HAS_NONE}")
        made = max(report.captioned, 1)
        return dg.MaterializeResult(
            metadata={
                "captioner": config.captioner_id(), "eligible": report.eligible, "reused": report.reused,
                "captioned": report.captioned, "failed": report.failed,
                "without_source_caption": report.without_source_caption,
                **({"without_source_caption_examples": dg.MetadataValue.json(report.without_source_caption_examples)}
                   if report.without_source_caption_examples else {}),
                "images_per_second": round(report.images_per_second, 2),
                "mean_words": round(report.words / made, 1) if report.captioned else 0.0,
                "in_100_200_words": round(report.in_100_200_words / made, 3) if report.captioned else 0.0,
                "failures": counts_table(report.failures, "reason"),
                "output_tokens": report.output_tokens,
                "output_tokens_per_second": round(report.output_tokens_per_second, 1),
                "model_busy_fraction": round(report.model_busy_fraction, 3),
                **units_metadata(report.units), "lance_commits": report.commits,
                **({"gpu_hours": round(report.gpu_hours, 4)} if report.gpu_hours is not None else {}),
                **lance_versions(**report.read_versions, captions=report.captions_version),
                **explorer.metadata(context.partition_key),
            },
            check_results=[rate_check("captions_coverage", checks, checked=report.eligible,
                                      failed=report.captioner_missing, offenders=report.offenders,
                                      eligible=report.eligible, missing=report.missing,
                                      without_source_caption=report.without_source_caption)],
            data_version=dg.DataVersion(f"captions@{report.captions_version}"),
        )

    return captions
