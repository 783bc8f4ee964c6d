"""Table sources (parquet files, Lance fragments, Hugging Face datasets): rows onto `RECORD_SCHEMA`.

A batch of a table goes through one pipeline in the worker that reads it: keys (given or
`<file>:<row>`, null and repeated keys refused) and image bytes (a binary column, a Hugging Face
`Image()` struct) in `prepare`; URLs fetched in the reader's sliding window
(`prx_core.sources.fetch.window`); then caption, embedding and metadata columns and the size
limits in `finish`. Joined tables are applied later, to every reader's
records alike (`prx_core.sources.joins`, in the `samples` unit).
Each refusal is recorded on its row with a reason; a refused row carries no bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.records import (
    CAPTION_TOO_LARGE,
    DOWNLOAD_ERROR,
    DUPLICATE_KEY,
    IMAGE_TOO_LARGE,
    NULL_KEY,
    RECORD_SCHEMA,
    BATCH_ROWS,
    TAKEN_DOWN,
    TAKEN_DOWN_MESSAGE,
    SeenKeys,
)
from prx_core.sources.row_ranges import check_row_groups, clip, covering
from prx_core.store.storage import filesystem_for, is_remote, lance_storage_options

IMG2DATASET_ERROR = "error_message"  # the column img2dataset writes beside a row it could not fetch


@dataclass
class Rows:
    """One batch of a table source on its way to `RECORD_SCHEMA`, one list entry per row."""

    keys: list[str]
    images: list[bytes | None]
    captions: list[str | None]
    embeddings: list[list[float] | None]
    metadata: list[dict[str, str]]
    urls: list[str | None]
    reasons: list[str | None]
    messages: list[str | None]

    def __len__(self) -> int:
        return len(self.keys)

    def refuse(self, i: int, reason: str, message: str) -> None:
        """The first refusal of a row wins: it is the cause an operator reads."""
        if self.reasons[i] is None:
            self.reasons[i], self.messages[i] = reason, message[:300]

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.reasons) if r is None]

    def slice(self, start: int, count: int) -> Rows:
        end = start + count
        return Rows(self.keys[start:end], self.images[start:end], self.captions[start:end],
                    self.embeddings[start:end], self.metadata[start:end], self.urls[start:end],
                    self.reasons[start:end], self.messages[start:end])

    def to_batch(self) -> pa.RecordBatch:
        n = len(self)
        keep = [r is None for r in self.reasons]
        rows = [{"source_key": self.keys[i], "image": (self.images[i] or b"") if keep[i] else b"",
                 "caption": self.captions[i] if keep[i] else None,
                 "embedding": self.embeddings[i] if keep[i] else None,
                 "reject_reason": self.reasons[i], "reject_message": self.messages[i],
                 "metadata": self.metadata[i] or None, "source_url": self.urls[i]} for i in range(n)]
        return pa.RecordBatch.from_pylist(rows, schema=RECORD_SCHEMA)


@dataclass(frozen=True)
class ReadGuard:
    """What an ingest unit keeps out while reading a table: the source keys taken down (refused
    before any fetch, `prx_core.stages.opt_out.takedowns`), and when its time for fetching ends (wall clock)."""

    deadline: float | None = None
    taken_down: frozenset[str] = frozenset()


@dataclass
class TableFile:
    """Where a batch came from: the default keys' file part, the file an HF `Image()` path is
    relative to, and the metadata columns this file carries (the spec's, plus the defaults of a
    URL table that the file has: `prx_core.sources.fetch.download.url_metadata_columns`)."""

    stem: str
    path: str
    storage_options: dict[str, Any] | None = None
    metadata_columns: tuple[str, ...] = ()
    guard: ReadGuard = field(default_factory=lambda: ReadGuard())


def source_columns(spec: SourceSpec) -> list[str]:
    """The columns of the source's own table a reader needs."""
    named = (spec.image_column, spec.url_column, spec.caption_column, spec.key_column, spec.embedding_column)
    return list(dict.fromkeys([c for c in named if c] + list(spec.metadata_columns)))


def prepare(spec: SourceSpec, batch: pa.RecordBatch, where: TableFile, first_row: int, seen: SeenKeys) -> Rows:
    """A table source's batch as rows: keys (a taken-down one refused: its URL is never fetched),
    and image bytes or the URLs to fetch."""
    rows = _keyed_rows(spec, batch, where.stem, first_row, seen)
    for i in rows.live() if where.guard.taken_down else ():
        if rows.keys[i] in where.guard.taken_down:
            rows.refuse(i, TAKEN_DOWN, TAKEN_DOWN_MESSAGE)
    _fill_images(spec, batch, rows, where)
    return rows


def finish(spec: SourceSpec, batch: pa.RecordBatch, rows: Rows, where: TableFile) -> pa.RecordBatch:
    """Rows (their URLs fetched) onto `RECORD_SCHEMA`: the other columns, then the size limits."""
    _carry_download_errors(batch, rows)
    _fill_columns(spec, batch, rows, where.metadata_columns or spec.metadata_columns)
    _check_sizes(spec, rows)
    return rows.to_batch()


def _keyed_rows(spec: SourceSpec, batch: pa.RecordBatch, stem: str, first_row: int, seen: SeenKeys) -> Rows:
    n = batch.num_rows
    given = batch.column(spec.key_column).cast(pa.string()).to_pylist() if spec.key_column else [None] * n
    rows = Rows(keys=[], images=[None] * n, captions=[None] * n, embeddings=[None] * n,
                metadata=[{} for _ in range(n)], urls=[None] * n, reasons=[None] * n, messages=[None] * n)
    for i, key in enumerate(given):
        row = f"row {first_row + i} of {stem}"
        if key is None:
            rows.keys.append(f"{stem}:{first_row + i}")
            if spec.key_column:
                rows.refuse(i, NULL_KEY, f"key column {spec.key_column!r} is null ({row})")
            continue
        rows.keys.append(key)
        if not seen.first(key):
            rows.refuse(i, DUPLICATE_KEY, f"key {key!r} given again ({row}): the first is kept")
    return rows


def _fill_images(spec: SourceSpec, batch: pa.RecordBatch, rows: Rows, where: TableFile) -> None:
    """Image bytes from the image column, or a URL: every live row left with no bytes and a URL
    (a `url_column` table, or an HF `Image()` whose path is a URL) is fetched by the window."""
    from prx_core.sources.hf_images import image_bytes

    if spec.url_column:
        rows.urls = batch.column(spec.url_column).cast(pa.string()).to_pylist()
        for i in rows.live():
            if not (rows.urls[i] or "").strip():
                rows.refuse(i, DOWNLOAD_ERROR, f"url column {spec.url_column!r} is null or empty: nothing to fetch")
    else:
        image_bytes(spec, batch.column(spec.image_column), rows, where)


def _carry_download_errors(batch: pa.RecordBatch, rows: Rows) -> None:
    """img2dataset's output keeps the rows it failed to download (`status` failed_to_download, an
    `error_message`, no image): they become `download_error` rejects with img2dataset's message,
    not images that are merely empty."""
    if IMG2DATASET_ERROR not in batch.schema.names:
        return
    errors = batch.column(IMG2DATASET_ERROR).cast(pa.string()).to_pylist()
    for i in rows.live():
        if not rows.images[i] and errors[i]:
            rows.refuse(i, DOWNLOAD_ERROR, f"not downloaded by the tool that wrote the source: {errors[i]}")


def _fill_columns(spec: SourceSpec, batch: pa.RecordBatch, rows: Rows, metadata_columns: tuple[str, ...]) -> None:
    if spec.caption_column:
        rows.captions = batch.column(spec.caption_column).cast(pa.string()).to_pylist()
    if spec.embedding_column:
        rows.embeddings = batch.column(spec.embedding_column).cast(pa.list_(pa.float32())).to_pylist()
    for name in metadata_columns:
        for i, value in enumerate(metadata_values(batch.column(name))):
            if value is not None:
                rows.metadata[i][name] = value


def metadata_values(column: pa.Array | pa.ChunkedArray) -> list[str | None]:
    """A column as metadata strings: scalars as text, anything nested as compact JSON."""
    import json

    if pa.types.is_nested(column.type) or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        return [None if v is None else json.dumps(v, default=repr, separators=(",", ":"))[:1000]
                for v in column.to_pylist()]
    return [None if v is None else str(v)[:1000] for v in column.to_pylist()]


def _check_sizes(spec: SourceSpec, rows: Rows) -> None:
    """The limits hold for every row, whatever its key (a default key is no exemption)."""
    for i in rows.live():
        image, caption = rows.images[i] or b"", rows.captions[i]
        if len(image) > spec.max_image_bytes:
            rows.refuse(i, IMAGE_TOO_LARGE, f"{len(image)} image bytes, over the limit {spec.max_image_bytes}")
        elif caption is not None and len(caption.encode("utf-8", "surrogatepass")) > spec.max_caption_bytes:
            size = len(caption.encode("utf-8", "surrogatepass"))
            rows.refuse(i, CAPTION_TOO_LARGE, f"{size} caption bytes, over the limit {spec.max_caption_bytes}")


def read_parquet(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None,
                 guard: ReadGuard | None = None, rows: tuple[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """A parquet file, or its rows [start, stop) (`rows`: a `samples` unit's range of a URL table,
    `prx_core.sources.row_ranges`): only the row groups covering them are read."""
    fs = filesystem_for(path, storage_options)
    where = TableFile(table_key_prefix(spec.uri, path), path, storage_options, guard=guard or ReadGuard())
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        columns = _present(spec, parquet.schema_arrow.names, path, where)
        if rows is None:
            check_row_groups(spec, parquet.metadata, columns, path)
            yield from _batches(spec, parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns), where)
            return
        meta = parquet.metadata
        groups, first = covering([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], *rows)
        check_row_groups(spec, meta, columns, path, groups)
        batches = parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns, row_groups=groups) if groups else ()
        yield from _batches(spec, clip(batches, first, *rows), where, first_row=rows[0])


def read_arrow(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None,
               guard: ReadGuard | None = None) -> Iterator[pa.RecordBatch]:
    """An Arrow IPC file (the stream format `datasets` writes, or the file format), one record batch
    in memory at a time, re-sliced to `BATCH_ROWS`; default keys `<file without .arrow>:<row>`."""
    fs = filesystem_for(path, storage_options)
    stem = table_key_prefix(spec.uri, path)
    where = TableFile(stem[: -len(".arrow")] if stem.lower().endswith(".arrow") else stem, path, storage_options,
                      guard=guard or ReadGuard())
    with fs.open(path, "rb") as handle:
        schema, batches = arrow_batches(handle)
        columns = _present(spec, schema.names, path, where)
        sliced = (b.select(columns).slice(at, BATCH_ROWS) for b in batches for at in range(0, b.num_rows, BATCH_ROWS))
        yield from _batches(spec, sliced, where)


def arrow_batches(handle: Any) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and the batches of an open Arrow IPC stream or file, read batch by batch."""
    try:
        reader = pa.ipc.open_stream(handle)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:  # not a stream: the IPC file format (magic `ARROW1`, footer at the end)
        handle.seek(0)
        file = pa.ipc.open_file(handle)
        return file.schema, (file.get_batch(i) for i in range(file.num_record_batches))


def read_lance(spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None,
               guard: ReadGuard | None = None, rows: tuple[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """A Lance fragment, or its rows [start, stop) (a `samples` unit's range of a URL table)."""
    import lance

    dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
    where = TableFile(f"fragment{fragment}", spec.uri, storage_options, guard=guard or ReadGuard())
    columns = _present(spec, dataset.schema.names, spec.uri, where)
    ranged = {} if rows is None else {"offset": rows[0], "limit": rows[1] - rows[0]}
    batches = dataset.get_fragment(int(fragment)).to_batches(columns=columns, batch_size=BATCH_ROWS, **ranged)
    yield from _batches(spec, batches, where, first_row=rows[0] if rows else 0)


def _batches(spec: SourceSpec, batches: Iterator[pa.RecordBatch], where: TableFile,
             first_row: int = 0) -> Iterator[pa.RecordBatch]:
    """The file's batches on `RECORD_SCHEMA`, in order, their URLs fetched in one sliding window;
    rows are numbered from `first_row` (a range's first row in its file)."""
    from prx_core.sources.fetch.window import FetchWindow

    def prepared() -> Iterator[tuple[pa.RecordBatch, Rows]]:
        row, seen = first_row, SeenKeys()
        for batch in batches:
            yield batch, prepare(spec, batch, where, row, seen)
            row += batch.num_rows

    with FetchWindow(spec.download, spec.max_image_bytes, where.storage_options, where.guard.deadline,
                     spec.uri) as window:
        yield from window.stream(prepared(), lambda batch, rows: finish(spec, batch, rows, where))


def _present(spec: SourceSpec, names: list[str], path: str, where: TableFile) -> list[str]:
    """The columns to read from a file with these `names` (a missing named column is an error that
    names the file); sets `where.metadata_columns`."""
    from prx_core.sources.fetch.download import url_metadata_columns

    columns = source_columns(spec)
    missing = [c for c in columns if c not in names]
    if missing:
        raise KeyError(f"source {spec.name!r}: {path} has no column(s) {missing} (has {names})")
    if IMG2DATASET_ERROR in names and IMG2DATASET_ERROR not in columns:
        columns.append(IMG2DATASET_ERROR)
    defaults = url_metadata_columns(spec, names) if spec.url_column else []
    where.metadata_columns = tuple(dict.fromkeys([*spec.metadata_columns, *defaults]))
    return list(dict.fromkeys([*columns, *where.metadata_columns]))


def table_key_prefix(uri: str, path: str) -> str:
    """The default key's file part: the file's path under the source root without `.parquet`
    (`a/part-0`, `b/part-0`: two folders' files never share keys), its stem for a one-file source."""
    import posixpath

    from prx_core.sources.folders.reader import relative_folder

    if path == uri or posixpath.normpath(path.split("://", 1)[-1]) == posixpath.normpath(uri.split("://", 1)[-1]):
        relative = posixpath.basename(path)
    else:
        relative = relative_folder(uri, path)
    return relative[: -len(".parquet")] if relative.lower().endswith(".parquet") else relative


def lance_options(uri: str, storage_options: dict[str, Any] | None) -> dict[str, str] | None:
    return lance_storage_options(storage_options) if is_remote(uri) else None
