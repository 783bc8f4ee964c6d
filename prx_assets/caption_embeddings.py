"""Asset `caption_embeddings` (+ `source_embeddings`): vectors for the explorer's similarity search."""


import dagster as dg
from dagster_ray import RayResource

from prx_assets.buckets import CHEAP
from prx_assets.common import GROUP, SOURCES, catalog_source, lance_versions, units_metadata
from prx_assets.rate_checks import rate_check, rate_description
from prx_core.stages.caption_embeddings import TABLES, CaptionEmbeddingsReport
from prx_core.stages.entry import Progress
from prx_resources import CaptionerResource, CatalogResource, EmbedderResource, StorageResource
from prx_resources.checks import ChecksResource
from prx_resources.ray import run_stage

CHECKS = [
    dg.AssetCheckSpec("caption_embeddings_coverage", asset="caption_embeddings", blocking=True,
                      description=rate_description("caption_embeddings_coverage",
                                                   "Captioned eligible contents with a caption embedding (an embedder "
                                                   "error fails its unit, so this counts what a run left out).")),
    dg.AssetCheckSpec("caption_embeddings_indexed", asset="caption_embeddings",
                      description="The vector indexes of caption_embeddings and source_embeddings cover every "
                                  "fragment (tables below the index threshold pass with a note)."),
    dg.AssetCheckSpec("caption_embeddings_source_dims", asset="caption_embeddings",
                      description="The source's embedding column has the width of source_embeddings "
                                  "(another width is not written)."),
]


def caption_embeddings_asset(captioner: CaptionerResource, embedder: EmbedderResource) -> dg.AssetsDefinition:
    @dg.asset(partitions_def=SOURCES, group_name=GROUP, deps=["captions", "samples"], check_specs=CHECKS,
              kinds={"ray", "lance"}, code_version=f"{embedder.config().version()}-{captioner.config().version()}",
              automation_condition=CHEAP)
    def caption_embeddings(
        context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource,
        captioner: CaptionerResource, embedder: EmbedderResource, ray: RayResource, checks: ChecksResource,
    ) -> dg.MaterializeResult:
        """MiniLM vectors of the source's captions (shared, upserted) and its own CLIP vectors
        (`source_embeddings`, replaced per source); cosine vector indexes `embedding_vector`."""
        catalog_source(context, catalog)
        config = embedder.config()
        report: CaptionEmbeddingsReport = run_stage(
            context, ray, "caption_embeddings", source=context.partition_key, storage=storage.storage(),
            captioner_version=captioner.config().version(), config=config, actors=embedder.actors,
            progress=Progress(f"caption_embeddings[{context.partition_key}]"))
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
                "embedded": report.embedded, "embeddings_per_second": round(report.embeddings_per_second, 1),
                "source_rows": report.source_rows, "skipped": report.skipped, "source_dim": report.source_dim or 0,
                "seconds": round(report.seconds, 2), **units_metadata(report.units), "lance_commits": report.commits,
                "indexes": dg.MetadataValue.json({t: r.indexes for t, r in report.indexes.items()}),
                "index_notes": dg.MetadataValue.json({t: c.note for t, c in coverage.items()}),
                **lance_versions(**report.read_versions, caption_embeddings=report.caption_embeddings_version,
                                 source_embeddings=report.source_embeddings_version),
            },
            check_results=checks,
            data_version=dg.DataVersion(
                f"caption_embeddings@{report.caption_embeddings_version}+{report.source_embeddings_version}"),
        )

    return caption_embeddings
