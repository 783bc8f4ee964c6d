"""Asset `text_latents` (optional): PRX's precomputed text latents of the source's captions."""

import dagster as dg
from dagster_ray import RayResource

from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    dataset_metadata,
    human_bytes,
    lance_versions,
    ops_metadata,
    per_second,
    rate,
    source_check,
    stage_metadata,
)
from prx_assets.rate_checks import rate_check, rate_description
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.entry import Progress
from prx_core.stages.text_latents import TextLatentsReport
from prx_resources import CaptionerResource, CatalogResource, StorageResource, TextLatentsResource, UnitsResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

CHECKS = [source_check("text_latents_coverage", "text_latents", blocking=True, description=rate_description(
    "text_latents_coverage", "Captioned eligible contents with a text latent (an encoder error fails its unit, so "
                             "this counts what a run left out); passes with a note while text_latents is off."))]
DESCRIPTION = ("Optional, off unless `text_latents.model` is set in PRX_CONFIG: PRX's precomputed text latents (the "
               "last hidden state of a checkpoint's text backbone over each caption, bfloat16, with attention masks), "
               "in the shared `text_latents` table keyed by (content_id, captioner version, encoder version). "
               "mds_shards stores them in each sample as `latent_caption_<preset>` / `attention_mask_caption_<preset>`. "
               "Never automatic (a model pass over every caption): materialize it before mds_shards.")


def text_latents_asset(captioner: CaptionerResource, latents: TextLatentsResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("text_latents", latents.version(), captioner.config().version()),
              description=DESCRIPTION, owners=OWNERS,  # never automatic: GPU work, for mds_shards (never automatic)
              pool="gpu" if latents.gpus else None)  # GPU encoders wait their turn with the captioner
    def text_latents(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, text_latents: TextLatentsResource, ray: RayResource, checks: ChecksResource,
        units: UnitsResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        config = text_latents.config()
        if config is None:
            context.log.info("text_latents is off (no `text_latents.model` in PRX_CONFIG): nothing to encode")
            return dg.MaterializeResult(
                metadata={"configured": False, "encoded": 0, **dataset_metadata(storage.storage(), 0, table="text_latents"),
                          **ops_metadata(None, 0.0), **lance_versions()},
                check_results=[dg.AssetCheckResult(check_name="text_latents_coverage", passed=True,
                                                   metadata={"note": "text_latents is off"})],
                data_version=dg.DataVersion("off"))
        report: TextLatentsReport = run_stage(
            context, ray, "text_latents", source=context.partition_key, storage=storage.storage(),
            captioner_version=captioner.config().version(), config=config, actors=text_latents.actors,
            gpus=text_latents.gpus, progress=Progress(f"text_latents[{context.partition_key}]"),
            **units.settings("text_latents"))
        coverage = rate_check("text_latents_coverage", checks, checked=report.captioned,
                              failed=max(report.captioned - report.covered, 0), captioned=report.captioned,
                              encoded=report.covered)
        return dg.MaterializeResult(
            metadata={
                "configured": True, "encoder": config.encoder_id(), "preset": config.preset,
                "captioned": report.captioned, "reused": report.reused, "encoded": report.encoded,
                "encoded_share": rate(report.covered, report.captioned),
                "latents_per_second": per_second(report.latents_per_second), "tokens": report.tokens,
                "truncated": report.truncated, "latent_bytes_written": dg.MetadataValue.int(report.latent_bytes),
                "latent_size_written": human_bytes(report.latent_bytes),
                **dataset_metadata(storage.storage(), report.covered, table="text_latents"),
                **stage_metadata(report, lance_commits=report.commits),
            },
            check_results=[coverage],
            data_version=content_version(context, covered=report.covered),
        )

    return text_latents
