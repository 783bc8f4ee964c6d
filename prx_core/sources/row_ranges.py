"""Row ranges of a table source's files: how a URL table of any size becomes many `samples` units.

Bytes mislead for a table of URLs: a few GB of parquet list ~100M URLs, and fetching them takes a
worker about an hour per 100k. So the `samples` planner cuts a URL table by rows (`unit_rows`):
whole files while they are small, and a bigger file into ranges of rows that end at its parquet
row groups where one falls inside the range, else inside a row group. What this module gives:
the rows of each file or Lance fragment (from footers and manifests: nothing is decoded), the
cut, and the reading of one range (the row groups covering it, the rows outside dropped). Rows are
numbered from the file's start, so a default key (`<file>:<row>`) never depends on the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from prx_core.sources.catalog import SourceSpec
from prx_core.store.storage import filesystem_for

if TYPE_CHECKING:
    import pyarrow.parquet as pq

THREADS = 8  # footers read at once while planning
ROW_GROUP_MAX_BYTES = 4 << 30  # what one parquet row group may decode to in an ingest worker
OTHER_COLUMNS_BYTES_PER_ROW = 1 << 20  # key, embedding and metadata columns of one row


def parquet_row_groups(path: str, storage_options: dict[str, Any] | None) -> list[int]:
    """The rows of each row group of one parquet file, from its footer."""
    import pyarrow.parquet as pq

    with filesystem_for(path, storage_options).open(path, "rb") as handle:
        metadata = pq.ParquetFile(handle).metadata
        return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def files_row_groups(paths: list[str], storage_options: dict[str, Any] | None,
                     threads: int = THREADS) -> list[list[int] | None]:
    """`parquet_row_groups` of every path, read on threads; None for a file whose footer cannot be
    read (its unit's reader then says why, as one `unreadable_fragment` reject)."""
    def groups(path: str) -> list[int] | None:
        try:
            return parquet_row_groups(path, storage_options)
        except Exception:  # a corrupt footer: planned as a whole file, refused when read
            return None

    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        return list(pool.map(groups, paths))


def check_row_groups(spec: SourceSpec, metadata: pq.FileMetaData, columns: list[str], path: str,
                     groups: list[int] | None = None) -> None:
    """Refuse, from the footer and before decoding anything, a file whose row group would decode to
    more than its rows may hold under the source's limits, or more than ROW_GROUP_MAX_BYTES (pyarrow
    decodes a row group's columns whole: a 19 KiB zstd file can ask for gigabytes). The file then
    becomes one `unreadable_fragment` reject naming the row group."""
    wanted = {c.split(".", 1)[0] for c in columns}
    per_row = spec.max_image_bytes + spec.max_caption_bytes + OTHER_COLUMNS_BYTES_PER_ROW
    for g in range(metadata.num_row_groups) if groups is None else groups:
        group = metadata.row_group(g)
        size = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                   if group.column(c).path_in_schema.split(".", 1)[0] in wanted)
        allowed = min(group.num_rows * per_row, ROW_GROUP_MAX_BYTES)
        if size > allowed:
            raise ValueError(f"{path}: row group {g} would decode to {size} bytes for {group.num_rows} rows, over the "
                             f"{allowed} its rows may hold (max_image_bytes + max_caption_bytes per row, at most "
                             f"{ROW_GROUP_MAX_BYTES} per row group): refused before decoding; rewrite the file with "
                             "smaller row groups if its images are legitimate")


def cut_rows(groups: list[int], unit_rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most `unit_rows` rows covering a file whose row groups hold
    `groups` rows: consecutive row groups while they fit, a bigger row group cut in equal parts.
    The same footer always gives the same ranges."""
    ranges: list[tuple[int, int]] = []
    start = offset = 0
    for rows in groups:
        if rows > unit_rows:
            if offset > start:
                ranges.append((start, offset))
            parts = -(-rows // unit_rows)
            ranges += [(offset + rows * k // parts, offset + rows * (k + 1) // parts) for k in range(parts)]
            start = offset + rows
        elif offset + rows - start > unit_rows:
            ranges.append((start, offset))
            start = offset
        offset += rows
    if offset > start or not ranges:
        ranges.append((start, offset))
    return ranges


def covering(groups: list[int], start: int, stop: int) -> tuple[list[int], int]:
    """The row groups holding rows [start, stop), and the file row at which the first of them begins."""
    picked, first, offset = [], None, 0
    for g, rows in enumerate(groups):
        if offset < stop and offset + rows > start:
            picked.append(g)
            first = offset if first is None else first
        offset += rows
    return picked, start if first is None else first


def clip(batches: Iterable[pa.RecordBatch], first: int, start: int, stop: int) -> Iterator[pa.RecordBatch]:
    """The rows [start, stop) of `batches`, whose first row is file row `first`."""
    row = first
    for batch in batches:
        lo, hi = max(start - row, 0), min(stop - row, batch.num_rows)
        if hi > lo:
            yield batch.slice(lo, hi - lo)
        row += batch.num_rows
        if row >= stop:
            return


def range_label(fragment: str, part: list[Any] | tuple[Any, ...] | None) -> str:
    """A fragment's name, with the range a unit reads of it (`part.parquet rows 0-100000`, `photos/a
    files from 'x.jpg' to 'y.jpg'`): what a reject standing for the range names."""
    if not part:
        return fragment
    lo, hi = part
    if isinstance(lo, int) or isinstance(hi, int):
        return f"{fragment} rows {lo}-{hi}"
    return f"{fragment} files {'from ' + repr(lo) if lo is not None else 'from the first'} " \
           f"{'to ' + repr(hi) + ' (excluded)' if hi is not None else 'to the last'}"
