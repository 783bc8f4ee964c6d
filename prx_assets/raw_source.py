"""Asset `raw_source`: the source as declared in the catalog, observed, not copied."""


import dagster as dg

from prx_assets.common import GROUP, OWNERS, SOURCES, catalog_source, size_metadata, where_value
from prx_assets.versions import digest
from prx_core.sources.readers import observe_source
from prx_resources import CatalogResource, StorageResource

DESCRIPTION = ("The source as the catalog declares it, observed, never copied: its files (or Lance fragments), "
               "their bytes, its records where that reads no image (`dagster/row_count`) and a fingerprint of "
               "names and sizes. Its data version is that fingerprint with the "
               "catalog entry, so `samples` is stale exactly when the source or how it is read changed.")
UNREAD = ("name", "weight")  # the partition key, and the training mixture: neither changes what is read


@dg.asset(partitions_def=SOURCES, group_name=GROUP, kinds=set(), code_version="1", description=DESCRIPTION,
          owners=OWNERS)
def raw_source(context: dg.AssetExecutionContext, catalog: CatalogResource, storage: StorageResource) -> dg.MaterializeResult:
    spec = catalog_source(context, catalog)
    seen = observe_source(spec, storage.storage_options)
    declared = {k: v for k, v in spec.to_dict().items() if k not in UNREAD}
    return dg.MaterializeResult(
        metadata={
            "format": spec.format, "dagster/uri": where_value(spec.uri), "prx/root": where_value(storage.storage().root),
            "fragments": seen["fragments"], "files": seen["files"], **size_metadata(seen["bytes"]),
            "fingerprint": seen["fingerprint"],
            **({"dagster/row_count": seen["rows"]} if seen["rows"] is not None else
               {"row_count": "not counted: a compressed or remote tar or Arrow stream is counted by reading it"}),
            "caption_column": spec.caption_column or "(sidecar or none)",
            "embedding_column": spec.embedding_column or "(none)",
        },
        data_version=dg.DataVersion(digest(seen["fingerprint"], declared)),
    )
