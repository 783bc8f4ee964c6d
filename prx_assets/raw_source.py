"""Asset `raw_source`: the source as declared in the catalog, observed, not copied."""


import dagster as dg

from prx_assets.common import GROUP, SOURCES, catalog_source
from prx_core.sources.readers import observe_source
from prx_resources import CatalogResource, StorageResource


@dg.asset(partitions_def=SOURCES, group_name=GROUP, kinds={"s3", "parquet"}, code_version="1")
def raw_source(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource) -> dg.MaterializeResult:
    """Lists the source's files or Lance fragments; its data version is a fingerprint of names and
    sizes, so `samples` is marked stale exactly when the source changed."""
    spec = catalog_source(context, catalog)
    seen = observe_source(spec, storage.storage_options)
    return dg.MaterializeResult(
        metadata={
            "format": spec.format, "uri": dg.MetadataValue.path(spec.uri), "fragments": seen["fragments"],
            "files": seen["files"], "bytes": seen["bytes"], "fingerprint": seen["fingerprint"],
            "caption_column": spec.caption_column or "(sidecar or none)",
            "embedding_column": spec.embedding_column or "(none)",
        },
        data_version=dg.DataVersion(seen["fingerprint"]),
    )
