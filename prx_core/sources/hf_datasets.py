"""`format: huggingface`: a Hugging Face dataset as it is kept on disk or in a bucket.

Two layouts, both read file by file (each file a work unit; nothing is loaded whole):

- a `Dataset.save_to_disk` folder: Arrow IPC stream files `data-*.arrow` beside `state.json` and
  `dataset_info.json`; a `DatasetDict` holds one such folder per split (`dataset_dict.json`),
  and every split is read (point `uri` at one split's folder to take only that one);
- a Hub snapshot: parquet files (`data/train-00000-of-00002.parquet`,
  `<config>/<split>-*.parquet`) beside `README.md`.

Columns not named in the catalog come from the dataset's features, resolved where each file is
read (a catalog load reads no data): the features `datasets` writes into every file's schema
metadata (key `huggingface`), else the column types. The image column is the first `Image()`
feature (a `struct<bytes, path>`); the caption is `text`, else `caption`, else the only string
column. Keys are `<file>:<row>` (the file's path under the root: two splits never share keys) or
the `key_column`.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.hf_images import is_image_struct
from prx_core.sources.tables import ReadGuard, arrow_batches, read_arrow, read_parquet, table_key_prefix
from prx_core.store.storage import filesystem_for

DATA_SUFFIXES = (".arrow", ".parquet")
CAPTION_NAMES = ("text", "caption")


def is_data_file(path: str) -> bool:
    """A dataset's data file (`path` under the dataset's folder): `.arrow` or `.parquet`, not a
    `datasets` cache file (`cache-*.arrow`, written beside a loaded dataset by `map`/`filter`) nor
    under a hidden folder of the dataset (`.cache/`)."""
    parts = path.split("://", 1)[-1].split("/")
    return (path.lower().endswith(DATA_SUFFIXES) and not parts[-1].startswith("cache-")
            and not any(p.startswith(".") for p in parts[:-1] if p not in (".", "..")))


def read_huggingface(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None,
                     guard: ReadGuard | None = None, rows: tuple[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """One data file of the dataset, its columns defaulted from its features (`resolve_columns`),
    or its rows [start, stop): a URL table's parquet file is cut by rows as a `parquet` source's is
    (an Arrow file has no footer that counts its rows without reading them, so it is read whole)."""
    schema = file_schema(path, storage_options)
    resolved = resolve_columns(spec, schema, path)
    if path.lower().endswith(".parquet"):
        yield from read_parquet(resolved, path, storage_options, guard, rows)
    elif rows is not None:
        raise ValueError(f"source {spec.name!r}: {path} is an Arrow file, read whole, not in row ranges")
    else:
        yield from read_arrow(resolved, path, storage_options, guard)


def file_schema(path: str, storage_options: dict[str, Any] | None) -> pa.Schema:
    """A data file's schema, metadata included, without reading its rows."""
    fs = filesystem_for(path, storage_options)
    with fs.open(path, "rb") as handle:
        if path.lower().endswith(".parquet"):
            return pq.ParquetFile(handle).schema_arrow
        schema, _ = arrow_batches(handle)
        return schema


def resolve_columns(spec: SourceSpec, schema: pa.Schema, path: str) -> SourceSpec:
    """`spec` with the image and caption columns the catalog left out taken from the file's
    features; a file whose image column cannot be told is an error saying how to name it."""
    if (spec.image_column or spec.url_column) and spec.caption_column:
        return spec
    features = hf_features(schema)
    image = spec.image_column
    if not image and not spec.url_column:
        image = image_column(features, schema)
        if image is None:
            shown = table_key_prefix(spec.uri, path) or posixpath.basename(path)
            raise ValueError(f"source {spec.name!r}: cannot tell the image column of {shown!r} (no Image() feature, "
                             f"no struct<bytes, path> column): name it in the catalog, image_column: <column> "
                             f"(columns: {', '.join(schema.names[:12])})")
    taken = {image, spec.url_column, spec.key_column, spec.embedding_column, *spec.metadata_columns}
    caption = spec.caption_column or caption_column(schema, taken)
    return replace(spec, image_column=image, caption_column=caption)


def hf_features(schema: pa.Schema) -> dict[str, Any]:
    """The `datasets` features stored in the schema metadata (`{"info": {"features": ...}}`), or {}."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        document = json.loads(raw)
    except ValueError:
        return {}
    features = (document.get("info") or {}).get("features") if isinstance(document, dict) else None
    return features if isinstance(features, dict) else {}


def image_column(features: dict[str, Any], schema: pa.Schema) -> str | None:
    """The first `Image()` feature that the file holds, else the first `struct<bytes, path>` column."""
    for name, feature in features.items():
        if isinstance(feature, dict) and feature.get("_type") == "Image" and name in schema.names:
            return name
    return next((f.name for f in schema if is_image_struct(f.type)), None)


def caption_column(schema: pa.Schema, taken: set[str | None]) -> str | None:
    """`text`, else `caption`, else the only string column not otherwise used; None when no column fits."""
    strings = [f.name for f in schema if f.name not in taken and (pa.types.is_string(f.type)
                                                                   or pa.types.is_large_string(f.type))]
    for name in CAPTION_NAMES:
        if name in strings:
            return name
    return strings[0] if len(strings) == 1 else None
