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

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders import list_folders, read_folder, relative_folder
from prx_core.sources.records import BATCH_ROWS, CAPTION_EXTENSIONS, IMAGE_EXTENSIONS, RECORD_SCHEMA, printable_name
from prx_core.sources.tables import lance_options, read_lance, read_parquet, table_key_prefix
from prx_core.sources.tars import is_shard, read_webdataset
from prx_core.store.storage import filesystem_for, is_remote

__all__ = ["RECORD_SCHEMA", "IMAGE_EXTENSIONS", "CAPTION_EXTENSIONS", "BATCH_ROWS", "list_fragments",
           "fragment_sizes", "read_fragment", "read_source", "observe_source", "table_key_prefix"]


def list_fragments(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Stable, sorted fragment ids of a source: the unit of parallel reading."""
    return [fragment for fragment, _ in fragment_sizes(spec, storage_options)]


def fragment_sizes(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """(fragment id, bytes) in id order: parquet files, tar shards (`.tar`, `.tar.gz`, `.tgz`), Lance
    fragments, or the folders of an image folder (each folder's files are listed by the worker that
    reads it, so the driver holds one entry per folder, never one per image)."""
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
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
    readers = {"parquet": read_parquet, "webdataset": read_webdataset, "imagefolder": read_folder,
               "lance": read_lance}
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


def observe_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the source is right now, without reading its contents: fragments, files, bytes and a
    fingerprint (names and sizes, or the Lance version) that changes when the source does."""
    fragments = list_fragments(spec, storage_options)
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
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
