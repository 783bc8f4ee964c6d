"""Readers for the catalog's source formats, all yielding one Arrow schema.

A source is split into fragments (parquet files, tar shards, folders of an image folder, Lance
fragments) so that Ray tasks can read them in parallel; each fragment streams Arrow record
batches of `RECORD_SCHEMA`. Local paths and s3:// URIs go through the same fsspec layer.
Nothing is dropped here: a WebDataset sample without an image member comes through with
empty image bytes, so decoding rejects it with a reason instead of losing it silently, and a
sample the reader refuses (a link, an oversized member, a null or repeated key) comes through
with a `reject_reason` (see `prx_core.sources.records`).
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders import list_folders, read_folder, relative_folder
from prx_core.sources.records import (
    BATCH_ROWS,
    CAPTION_EXTENSIONS,
    CAPTION_TOO_LARGE,
    DUPLICATE_KEY,
    IMAGE_EXTENSIONS,
    IMAGE_TOO_LARGE,
    NULL_KEY,
    RECORD_SCHEMA,
    SeenKeys,
    printable_name,
)
from prx_core.sources.tars import is_shard, read_webdataset
from prx_core.store.storage import filesystem_for, is_remote, lance_storage_options

__all__ = ["RECORD_SCHEMA", "IMAGE_EXTENSIONS", "CAPTION_EXTENSIONS", "BATCH_ROWS", "list_fragments",
           "fragment_sizes", "read_fragment", "read_source", "observe_source"]


def list_fragments(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Stable, sorted fragment ids of a source: the unit of parallel reading."""
    return [fragment for fragment, _ in fragment_sizes(spec, storage_options)]


def fragment_sizes(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """(fragment id, bytes) in id order: parquet files, tar shards (`.tar`, `.tar.gz`, `.tgz`), Lance
    fragments, or the folders of an image folder (each folder's files are listed by the worker that
    reads it, so the driver holds one entry per folder, never one per image)."""
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=_lance_options(spec.uri, storage_options))
        return [(str(f.fragment_id), sum(int(d.file_size_bytes or 0) for d in f.metadata.files))
                for f in sorted(dataset.get_fragments(), key=lambda f: f.fragment_id)]
    fs = filesystem_for(spec.uri, storage_options)
    if not fs.exists(spec.uri):  # an empty listing would otherwise ingest nothing, silently
        raise FileNotFoundError(f"source {spec.name!r}: {spec.uri} does not exist")
    if spec.format == "parquet":
        return _glob_sizes(fs, spec.uri, lambda p: p.lower().endswith(".parquet"))
    if spec.format == "webdataset":
        return _glob_sizes(fs, spec.uri, is_shard)
    if spec.format == "imagefolder":
        return list_folders(fs, spec.uri)
    raise ValueError(f"unknown source format {spec.format!r}")


def read_fragment(
    spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None = None
) -> Iterator[pa.RecordBatch]:
    """Stream one fragment as record batches of `RECORD_SCHEMA`. A fragment id that is not under
    the source's root (an edited manifest, `<root>/../x`) is an error, never a read."""
    if spec.format != "lance" and fragment != spec.uri:
        relative_folder(spec.uri, fragment)
    readers = {"parquet": _read_parquet, "webdataset": read_webdataset, "imagefolder": read_folder,
               "lance": _read_lance}
    yield from readers[spec.format](spec, fragment, storage_options)


def read_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> Iterator[pa.RecordBatch]:
    for fragment in list_fragments(spec, storage_options):
        yield from read_fragment(spec, fragment, storage_options)


def _glob_sizes(fs: Any, uri: str, wanted: Any) -> list[tuple[str, int]]:
    """(file, bytes) under `uri` (or `uri` itself) whose name `wanted` accepts, sorted, as full URIs."""
    prefix = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
    if fs.isfile(uri):
        return [(uri, int(fs.info(uri).get("size") or 0))]
    found = fs.find(uri, detail=True)
    return sorted((prefix + p if prefix and not p.startswith(prefix) else p, int(info.get("size") or 0))
                  for p, info in found.items() if wanted(p))


def table_key_prefix(uri: str, path: str) -> str:
    """The default key's file part: the file's path under the source root without `.parquet`
    (`a/part-0`, `b/part-0`: two folders' files never share keys), its stem for a one-file source."""
    if path == uri or posixpath.normpath(path.split("://", 1)[-1]) == posixpath.normpath(uri.split("://", 1)[-1]):
        relative = posixpath.basename(path)
    else:
        relative = relative_folder(uri, path)
    return relative[: -len(".parquet")] if relative.lower().endswith(".parquet") else relative


def _read_parquet(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    columns = [c for c in (spec.image_column, spec.caption_column, spec.key_column, spec.embedding_column) if c]
    fs = filesystem_for(path, storage_options)
    stem, seen, row = table_key_prefix(spec.uri, path), SeenKeys(), 0
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        missing = [c for c in columns if c not in parquet.schema_arrow.names]
        if missing:
            raise KeyError(f"source {spec.name!r}: {path} has no column(s) {missing} (has {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield _normalize(spec, batch, stem, row, seen)
            row += batch.num_rows


def _read_lance(spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    import lance

    dataset = lance.dataset(spec.uri, storage_options=_lance_options(spec.uri, storage_options))
    columns = [c for c in (spec.image_column, spec.caption_column, spec.key_column, spec.embedding_column) if c]
    row, seen = 0, SeenKeys()
    for batch in dataset.get_fragment(int(fragment)).to_batches(columns=columns, batch_size=BATCH_ROWS):
        yield _normalize(spec, batch, f"fragment{fragment}", row, seen)
        row += batch.num_rows


def _normalize(spec: SourceSpec, batch: pa.RecordBatch, stem: str, first_row: int, seen: SeenKeys) -> pa.RecordBatch:
    """Map a table source's columns onto `RECORD_SCHEMA`; default key: `<file>:<row>`. A null key
    (under the file-and-row key), a key already given earlier in the same file, or an image or
    caption over the source's limits is refused here with its reason."""
    n = batch.num_rows
    images = batch.column(spec.image_column).cast(pa.large_binary())
    captions = batch.column(spec.caption_column).cast(pa.string()) if spec.caption_column else pa.nulls(n, pa.string())
    if spec.embedding_column:
        embeddings = batch.column(spec.embedding_column).cast(pa.list_(pa.float32()))
    else:
        embeddings = pa.nulls(n, pa.list_(pa.float32()))
    image_sizes = pc.fill_null(pc.binary_length(images), 0).to_pylist()
    caption_sizes = pc.fill_null(pc.binary_length(captions.cast(pa.binary())), 0).to_pylist()
    given = batch.column(spec.key_column).cast(pa.string()).to_pylist() if spec.key_column else [None] * n
    keys, reasons, messages = [], [], []
    for i in range(n):
        key, row = given[i], f"row {first_row + i} of {stem}"
        reason = message = None
        if key is None:
            key = f"{stem}:{first_row + i}"
            if spec.key_column:
                reason, message = NULL_KEY, f"key column {spec.key_column!r} is null ({row})"
        elif not seen.first(key):
            reason, message = DUPLICATE_KEY, f"key {key!r} given again ({row}): the first is kept"
        elif image_sizes[i] > spec.max_image_bytes:
            reason, message = IMAGE_TOO_LARGE, f"{image_sizes[i]} image bytes, over the limit {spec.max_image_bytes}"
        elif caption_sizes[i] > spec.max_caption_bytes:
            reason = CAPTION_TOO_LARGE
            message = f"{caption_sizes[i]} caption bytes, over the limit {spec.max_caption_bytes}"
        keys.append(key)
        reasons.append(reason)
        messages.append(message)
    if any(reasons):  # a refused row carries no bytes, caption or embedding
        keep = pa.array([r is None for r in reasons])
        images = pc.if_else(keep, images, pa.scalar(b"", pa.large_binary()))
        captions = pc.if_else(keep, captions, pa.scalar(None, pa.string()))
        embeddings = pc.if_else(keep, embeddings, pa.scalar(None, pa.list_(pa.float32())))
    return pa.RecordBatch.from_arrays(
        [pa.array(keys, pa.string()), images, captions, embeddings, pa.array(reasons, pa.string()),
         pa.array(messages, pa.string())], schema=RECORD_SCHEMA)


def _lance_options(uri: str, storage_options: dict[str, Any] | None) -> dict[str, str] | None:
    return lance_storage_options(storage_options) if is_remote(uri) else None


def observe_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the source is right now, without reading its contents: fragments, files, bytes and a
    fingerprint (names and sizes, or the Lance version) that changes when the source does."""
    fragments = list_fragments(spec, storage_options)
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=_lance_options(spec.uri, storage_options))
        entries = [f"lance@{dataset.version}"]
        files, size = len(dataset.get_fragments()), 0
    else:
        fs = filesystem_for(spec.uri, storage_options)
        details = fs.find(spec.uri, detail=True) if not fs.isfile(spec.uri) else {spec.uri: fs.info(spec.uri)}
        entries = sorted(f"{name}\t{info.get('size', 0)}" for name, info in details.items())
        entries = [printable_name(e) for e in entries]  # a non-UTF-8 file name must not fail the hash
        files, size = len(entries), sum(int(info.get("size") or 0) for info in details.values())
    digest = hashlib.sha256("\n".join([spec.format, *entries]).encode()).hexdigest()[:16]
    return {"fragments": len(fragments), "files": files, "bytes": size, "fingerprint": digest}
