"""Asset `caption_embeddings` (+ `source_embeddings`): vectors for the explorer's similarity search."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.conditions import CHEAP
from prx_assets.common import (
    GROUP,
    OWNERS,
    SOURCES,
    catalog_source,
    dataset_metadata,
    per_second,
    rate,
    source_check,
    stage_metadata,
)
from prx_assets.rate_checks import rate_check, rate_description
from prx_assets.versions import content_version
from prx_assets.declared import from_stage
from prx_core.stages.caption_embeddings import TABLES, CaptionEmbeddingsReport
from prx_core.stages.entry import Progress
from prx_resources import CaptionerResource, CatalogResource, EmbedderResource, StorageResource, UnitsResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

CHECKS = [
    source_check("caption_embeddings_coverage", "caption_embeddings", blocking=True,
                 description=rate_description("caption_embeddings_coverage",
                                              "Captioned eligible contents with a caption embedding (an embedder "
                                              "error fails its unit, so this counts what a run left out).")),
    source_check("caption_embeddings_indexed", "caption_embeddings",
                 description="The vector indexes of caption_embeddings and source_embeddings cover every "
                             "fragment (tables below the index threshold pass with a note)."),
    source_check("caption_embeddings_source_dims", "caption_embeddings",
                 description="The source's embedding column has the width of source_embeddings "
                             "(another width is not written)."),
]
DESCRIPTION = ("Vectors for the explorer's similarity search: MiniLM vectors of the source's captions (the shared "
               "`caption_embeddings`, upserted by content) and the source's own CLIP vectors (`source_embeddings`, "
               "replaced per source), with cosine vector indexes `embedding_vector`. Nothing downstream reads them.")


def caption_embeddings_asset(captioner: CaptionerResource, embedder: EmbedderResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, check_specs=CHECKS, kinds={"ray", "lance"},
              **from_stage("caption_embeddings", embedder.config().version(), captioner.config().version()),
              automation_condition=CHEAP, description=DESCRIPTION, owners=OWNERS)
    def caption_embeddings(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, embedder: EmbedderResource, ray: RayResource, checks: ChecksResource,
        units: UnitsResource,
    ) -> dg.MaterializeResult:
        catalog_source(context, catalog)
        config = embedder.config()
        report: CaptionEmbeddingsReport = run_stage(
            context, ray, "caption_embeddings", source=context.partition_key, storage=storage.storage(),
            captioner_version=captioner.config().version(), config=config, actors=embedder.actors,
            progress=Progress(f"caption_embeddings[{context.partition_key}]"), **units.settings("caption_embeddings"))
        coverage = {t: report.coverage[t] for t in TABLES if t in report.coverage}
        checks = [
            rate_check("caption_embeddings_coverage", checks, checked=report.captioned,
                       failed=max(report.captioned - report.covered, 0), captioned=report.captioned,
                       embedded=report.covered),
            dg.AssetCheckResult(check_name="caption_embeddings_indexed", severity=dg.AssetCheckSeverity.WARN,
                                passed=all(c.complete for c in coverage.values()),
                                metadata={f"{t}": c.note for t, c in coverage.items()}),
            dg.AssetCheckResult(check_name="caption_embeddings_source_dims", passed=report.dim_mismatch is None,
                                metadata={"source_dim": report.source_dim or 0, "note": report.dim_mismatch or "ok"}),
        ]
        return dg.MaterializeResult(
            metadata={
                "embedder": config.embedder_id(), "captioned": report.captioned, "reused": report.reused,
                "embedded": report.embedded, "embedded_share": rate(report.covered, report.captioned),
                "embeddings_per_second": per_second(report.embeddings_per_second),
                "source_rows": report.source_rows, "skipped": report.skipped, "source_dim": report.source_dim or 0,
                "index_notes": dg.MetadataValue.json({t: c.note for t, c in coverage.items()}),
                **dataset_metadata(storage.storage(), report.covered, table="caption_embeddings"),
                **stage_metadata(report, lance_commits=report.commits,
                                indexes={t: r.indexes for t, r in report.indexes.items()}),
            },
            check_results=checks,
            # vectors are stored once per content and model versions (the source's are copied from `samples`):
            # the captions' and samples' versions, the embedder, and what the partition holds after the run
            data_version=content_version(context, covered=report.covered, source_rows=report.source_rows,
                                         source_dim=report.source_dim, dim_mismatch=report.dim_mismatch),
        )

    return caption_embeddings
