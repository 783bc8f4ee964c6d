"""Image columns of table sources: raw bytes, or a Hugging Face `Image()` feature.

A `datasets` `Image()` column is stored as `struct<bytes: binary, path: string>`: the bytes when
the dataset embeds them, else a path (relative to the data file, absolute, or a URL / S3 key).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def image_bytes(spec: Any, column: pa.Array | pa.ChunkedArray, rows: Any, where: Any) -> None:
    """Fill `rows.images` from an image column of `where`'s batch."""
    rows.images = column.cast(pa.large_binary()).to_pylist()
