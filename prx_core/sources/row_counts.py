"""How many records a source holds, from what tells it without reading an image.

`raw_source` reports it as Dagster's `dagster/row_count` (what every asset's materialization
carries) and `prx-corpus plan` scales its sample by it. Where the format keeps the count it is
read: a Lance dataset's manifest, parquet footers, the image files an image folder's walk already
listed. Where only the files' own framing tells (tar headers, Arrow IPC batch headers), they are
counted when that is cheap: local files, a tar without compression (headers reached by seeking
past each member), an Arrow file memory-mapped (batches are not copied). A gzipped or remote tar
or Arrow stream would be read whole just to count it: `None`, and the caller says so.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.records import IMAGE_EXTENSIONS
from prx_core.store.storage import filesystem_for, is_remote

THREADS = 8  # files counted at once (footer reads, header scans)


def source_rows(spec: SourceSpec, files: list[tuple[str, int]], storage_options: dict[str, Any] | None,
                images: int | None = None) -> int | None:
    """The source's records: `files` are its fragments as listed ((path, bytes); an image folder's
    are folders), `images` an image folder's image files when its walk counted them."""
    if spec.format == "lance":
        import lance

        from prx_core.sources.tables import lance_options

        return lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options)).count_rows()
    if spec.format == "imagefolder":
        return images
    paths = [p for p, _ in files]
    if spec.format in ("parquet", "huggingface") and all(p.lower().endswith(".parquet") for p in paths):
        return _sum(lambda p: _parquet_rows(p, storage_options), paths)
    if is_remote(spec.uri):
        return None
    if spec.format == "webdataset":
        return None if any(p.lower().endswith((".gz", ".tgz")) for p in paths) else _sum(_tar_samples, paths)
    if spec.format == "huggingface":
        return _sum(lambda p: _parquet_rows(p, storage_options) if p.lower().endswith(".parquet") else _arrow_rows(p),
                    paths)
    return None


def _sum(count: Any, paths: Iterable[str]) -> int:
    with ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(count, paths))


def _parquet_rows(path: str, storage_options: dict[str, Any] | None) -> int:
    import pyarrow.parquet as pq

    with filesystem_for(path, storage_options).open(path, "rb") as handle:
        return pq.ParquetFile(handle).metadata.num_rows


def _tar_samples(path: str) -> int:
    """Samples of a local uncompressed shard with an image member: its keys, from the headers."""
    from prx_core.sources.tar_headers import BoundedTarInfo
    from prx_core.sources.tars import member_key

    keys = set()
    try:
        with tarfile.open(path, "r:", tarinfo=BoundedTarInfo) as tar:  # seeks past each member's data
            while (member := tar.next()) is not None:
                tar.members.clear()
                key, ext = member_key(member.name)
                if ext in IMAGE_EXTENSIONS:  # the reader's rule for an image member
                    keys.add(key)
    except (tarfile.TarError, OSError):  # the reader refuses what follows with its own error
        pass
    return len(keys)


def _arrow_rows(path: str) -> int:
    """Rows of a local Arrow IPC stream or file, memory-mapped: only batch headers are parsed."""
    import pyarrow as pa

    from prx_core.sources.tables import arrow_batches

    if not os.path.isfile(path):
        return 0
    with pa.memory_map(path) as source:
        _, batches = arrow_batches(source)
        return sum(batch.num_rows for batch in batches)
