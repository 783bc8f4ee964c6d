"""Asset `captions`: VLM re-captioning of eligible samples, each content once per captioner (a
source caption once per sample text), every caption checked before it is stored."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import (
    GROUP,
    md_table,
    OWNERS,
    SOURCES,
    catalog_source,
    counts_table,
    dataset_metadata,
    per_second,
    rate,
    source_check,
    stage_metadata,
)
from prx_assets.rate_checks import rate_check, rate_description
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.models.captioning import SOURCE_HAS_NONE
from prx_core.models.fused import check_fusable
from prx_core.stages.captions.report import CaptionsReport
from prx_core.stages.captions.quality import quality_table, verdict_counts
from prx_core.stages.entry import Progress
from prx_resources import (
    CaptionerResource,
    CatalogResource,
    ExplorerResource,
    StorageResource,
    TextLatentsResource,
    UnitsResource,
)
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

COVERAGE = ("Eligible (bucketed) contents of the source the captioner failed on (stored with their error and "
            "retried on the next run); mds_shards refuses them (reject `no_caption`). Under the `source` captioner a "
            "content the source has no caption for is not a failure: it is counted apart (`without_source_caption`) "
            "and refused by mds_shards the same way, and a source with no caption at all fails the captions run.")
QUALITY = ("Eligible captions the caption checks refused twice (a repetition loop, the token cap, a refusal, a "
           "prompt echo, special tokens, too few or too many words, empty: prx_core.models.caption_checks), each "
           "retried once with the fallback decoding and then stored as rejected: never shipped (mds_shards rejects "
           "them as caption_rejected). Warns above `checks.captions_quality_warn`.")
CHECKS = [source_check("captions_coverage", "captions", blocking=True,
                       description=rate_description("captions_coverage", COVERAGE)),
          source_check("captions_quality", "captions", blocking=True,
                       description=rate_description("captions_quality", QUALITY))]
DESCRIPTION = ("A caption of every eligible (bucketed) content of the source by the configured captioner, in the "
               "shared `captions` table keyed by content_id and captioner version: the same bytes in two sources, a "
               "rerun or a resumed run reuse the stored caption (a source caption belongs to its sample: keyed by "
               "content and its own text). Every generated caption is checked before it is stored, a refused one "
               "retried once with the fallback decoding. Never automatic (it is the dominant cost): "
               "materialize by hand or by backfill; one at a time in the `gpu` pool.")


def quality_check(checks: ChecksResource, report: CaptionsReport) -> dg.AssetCheckResult:
    """captions_quality: rejected / eligible; fails (blocking) above `captions_quality`, warns above
    `captions_quality_warn`, with the counts per problem and a few rejected samples."""
    result = rate_check("captions_quality", checks, checked=report.eligible, failed=report.rejected,
                        offenders=report.rejected_offenders, verdicts=dg.MetadataValue.json(verdict_counts(report.quality)),
                        problems=md_table(quality_table(report.quality), ["problem", "retried", "rejected", "flagged"]),
                        fallbacks=report.fallbacks, warn_above=checks.captions_quality_warn)
    rate = report.rejected / report.eligible if report.eligible else 0.0
    if result.passed and rate > checks.captions_quality_warn:
        return dg.AssetCheckResult(check_name=result.check_name, passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description=f"{result.description}; above the warning threshold "
                                               f"{checks.captions_quality_warn:.3%}", metadata=result.metadata)
    return result


def captions_asset(captioner: CaptionerResource, latents: TextLatentsResource) -> dg.AssetsDefinition:
    if latents.fused:  # refused when the definitions load, not when a run reaches the captioner
        fused = latents.config()
        if fused is None:
            raise ValueError("text_latents.fused is set but text_latents.model is not: name the checkpoint")
        check_fusable(captioner.config(), fused)

    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("captions", captioner.config().version()), pool="gpu", description=DESCRIPTION,
              owners=OWNERS)
    def captions(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, ray: RayResource, explorer: ExplorerResource, checks: ChecksResource,
        units: UnitsResource, text_latents: TextLatentsResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        store, config = storage.storage(), captioner.config()
        report: CaptionsReport = run_stage(context, ray, "captions", source=context.partition_key, storage=store,
                                           config=config, actors=captioner.actors,
                                           fused=text_latents.config() if text_latents.fused else None,
                                           progress=Progress(f"captions[{context.partition_key}]"),
                                           **units.settings("captions"))
        if report.without_source_caption:
            context.log.warning(f"captions[{context.partition_key}]: {report.without_source_caption} of "
                                f"{report.eligible} eligible contents have no source caption; mds_shards refuses "
                                f"them (no_caption): {SOURCE_HAS_NONE}")
        made = max(report.captioned - report.rejected_now, 1)
        held = report.shippable  # eligible contents with a caption mds_shards ships, after the run
        return dg.MaterializeResult(
            metadata={
                "captioner": config.captioner_id(), "eligible": report.eligible, "reused": report.reused,
                "captioned": report.captioned, "failed": report.failed, "captioned_share": rate(held, report.eligible),
                "without_source_caption": report.without_source_caption,
                **({"without_source_caption_examples": dg.MetadataValue.json(report.without_source_caption_examples)}
                   if report.without_source_caption_examples else {}),
                "images_per_second": per_second(report.images_per_second),
                "mean_words": dg.MetadataValue.float(round(report.words / made, 1) if report.captioned else 0.0),
                "in_100_200_words": rate(report.in_100_200_words, made if report.captioned else 0),
                "failures": counts_table(report.failures, "reason"),
                "rejected": report.rejected, "retried": report.retried, "flagged": report.flagged,
                "fallbacks": report.fallbacks, "rechecked": report.rechecked,
                "caption_problems": md_table(quality_table(report.quality), ["problem", "retried", "rejected", "flagged"]),
                "caption_verdicts": dg.MetadataValue.json(verdict_counts(report.quality)),
                "output_tokens_per_second": per_second(report.output_tokens_per_second),
                **({"gpu_hours": dg.MetadataValue.float(round(report.gpu_hours, 4))} if report.gpu_hours is not None else {}),
                **dataset_metadata(store, held, table="captions"),
                **stage_metadata(report, lance_commits=report.commits, output_tokens=report.output_tokens,
                                model_busy_fraction=round(report.model_busy_fraction, 3)),
                **({"latents_encoded": report.latents_encoded} if text_latents.fused else {}),
                **explorer.metadata(context.partition_key),
            },
            check_results=[rate_check("captions_coverage", checks, checked=report.eligible,
                                      failed=report.captioner_missing, offenders=report.offenders,
                                      eligible=report.eligible, missing=report.missing,
                                      without_source_caption=report.without_source_caption),
                           quality_check(checks, report)],
            # model outputs are stored once per content and captioner and reused: the buckets' version, the
            # captioner, and what the partition holds after the run (a retried failure now captioned changes it)
            data_version=content_version(context, eligible=report.eligible, missing=report.missing,
                                         without_source_caption=report.without_source_caption,
                                         quality=sorted(report.quality.items())),
        )

    return captions
