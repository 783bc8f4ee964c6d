"""Readers for the catalog's source formats, all yielding one Arrow schema.

A source is split into fragments (parquet files, tar shards, folders of an image folder, Lance
fragments, a Hugging Face dataset's Arrow or parquet files) so that Ray tasks can read them in
parallel; each fragment streams Arrow record batches of `RECORD_SCHEMA`. Local paths and s3://
URIs go through the same fsspec layer. Nothing is dropped here: a WebDataset sample without an
image member comes through with empty image bytes, so decoding rejects it with a reason instead
of losing it silently, and a sample the reader refuses (a link, an oversized member, a null or
repeated key) comes through with a `reject_reason` (see `prx_core.sources.records`).
"""

from __future__ import annotations

import hashlib
import posixpath
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from prx_core.sources.catalog import CatalogError, SourceSpec
from prx_core.sources.folders.reader import read_folder, relative_folder
from prx_core.sources.folders.walk import FolderEntry, fingerprint_lines, fragments_of, walk_folders
from prx_core.sources.hf_datasets import is_data_file, read_huggingface
from prx_core.sources.records import BATCH_ROWS, CAPTION_EXTENSIONS, IMAGE_EXTENSIONS, RECORD_SCHEMA, printable_name
from prx_core.sources.tables import ReadGuard, lance_options, read_lance, read_parquet, table_key_prefix
from prx_core.sources.tars import is_shard, read_webdataset
from prx_core.store.storage import filesystem_for, is_remote

__all__ = ["RECORD_SCHEMA", "IMAGE_EXTENSIONS", "CAPTION_EXTENSIONS", "BATCH_ROWS", "list_fragments",
           "fragment_sizes", "folder_entries", "read_fragment", "read_source", "observe_source", "table_key_prefix"]


def list_fragments(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Stable, sorted fragment ids of a source: the unit of parallel reading."""
    return [fragment for fragment, _ in fragment_sizes(spec, storage_options)]


def fragment_sizes(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """(fragment id, bytes) in id order: parquet files, tar shards (`.tar`, `.tar.gz`, `.tgz`), Lance
    fragments, a Hugging Face dataset's `.arrow`/`.parquet` files, or the folders of an image folder
    (walked in parallel, each folder reduced where it is listed: `prx_core.sources.folders.walk`;
    the driver holds one entry per folder, never one per image). A folder holding none of its format's files but others is a
    `CatalogError` naming what it holds and the format it looks like."""
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
        return [(str(f.fragment_id), sum(int(d.file_size_bytes or 0) for d in f.metadata.files))
                for f in sorted(dataset.get_fragments(), key=lambda f: f.fragment_id)]
    if spec.format == "imagefolder":
        return fragments_of(folder_entries(spec, storage_options))
    fs = filesystem_for(spec.uri, storage_options)
    if not fs.exists(spec.uri):  # an empty listing would otherwise ingest nothing, silently
        raise FileNotFoundError(f"source {spec.name!r}: {spec.uri} does not exist")
    if spec.format == "parquet":
        return _data_sizes(spec, fs, lambda p: p.lower().endswith(".parquet"), ".parquet file")
    if spec.format == "webdataset":
        return _data_sizes(spec, fs, is_shard, ".tar shard")
    if spec.format == "huggingface":
        return _data_sizes(spec, fs, is_data_file, ".arrow or .parquet file")
    raise ValueError(f"unknown source format {spec.format!r}")


def folder_entries(spec: SourceSpec, storage_options: dict[str, Any] | None = None,
                   cut_every: int = 0) -> list[FolderEntry]:
    """An image folder's walk, one record per folder (`prx_core.sources.folders.walk`); with
    `cut_every`, where each folder of more image files may be cut (the `samples` planner's)."""
    if not filesystem_for(spec.uri, storage_options).exists(spec.uri):
        raise FileNotFoundError(f"source {spec.name!r}: {spec.uri} does not exist")
    return walk_folders(spec.uri, storage_options, cut_every=cut_every)


def read_fragment(
    spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None = None, guard: ReadGuard | None = None,
    part: tuple[Any, Any] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Stream one fragment as record batches of `RECORD_SCHEMA`, or the `part` of it a `samples`
    unit reads: rows [start, stop) of a parquet file (a Hugging Face snapshot's too) or Lance fragment, image files named from
    `lo` up to `hi` (excluded; None: open) of a folder. A fragment id that is not under the
    source's root (an edited manifest, `<root>/../x`) is an error, never a read. A table's rows
    `guard` names as taken down are refused before any fetch; its URLs not fetched by the guard's
    deadline are `not_fetched` rejects."""
    if spec.format != "lance" and fragment != spec.uri:
        relative_folder(spec.uri, fragment)
    ranged = {} if part is None else {"names" if spec.format == "imagefolder" else "rows": tuple(part)}
    if part is not None and spec.format not in ("parquet", "lance", "imagefolder", "huggingface"):
        raise ValueError(f"source {spec.name!r}: a {spec.format} fragment is read whole, not in parts")
    tables = {"parquet": read_parquet, "lance": read_lance, "huggingface": read_huggingface}
    if spec.format in tables:
        yield from tables[spec.format](spec, fragment, storage_options, guard, **ranged)
        return
    files = {"webdataset": read_webdataset, "imagefolder": read_folder}
    yield from files[spec.format](spec, fragment, storage_options, **ranged)


def read_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> Iterator[pa.RecordBatch]:
    for fragment in list_fragments(spec, storage_options):
        yield from read_fragment(spec, fragment, storage_options)


def _data_sizes(spec: SourceSpec, fs: Any, wanted: Any, what: str) -> list[tuple[str, int]]:
    """(file, bytes) under the source's `uri` (or `uri` itself) whose path under `uri` `wanted`
    accepts (a hidden folder above the root is the operator's choice, not a cache), sorted, as full URIs. A folder holding files but none of these is an error naming what it holds (an
    empty folder lists nothing: the `samples` stage's empty-source guard speaks for it)."""
    uri = spec.uri
    prefix = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
    if fs.isfile(uri):
        return [(uri, int(fs.info(uri).get("size") or 0))]
    found = {prefix + p if prefix and not p.startswith(prefix) else p: int(info.get("size") or 0)
             for p, info in fs.find(uri, detail=True).items()}
    root = uri.split("://", 1)[-1].rstrip("/") + "/"
    sizes = sorted((p, size) for p, size in found.items() if wanted(p.split("://", 1)[-1].removeprefix(root)))
    if found and not sizes:
        raise CatalogError(f"source {spec.name!r}: no {what} under {uri} ({describe_files(spec.format, list(found))})")
    return sizes


def describe_files(fmt: str, paths: list[str]) -> str:
    """What a folder holds, by extension, and the format it looks like: `found 3 .arrow files, 2
    .json files: a Dataset.save_to_disk folder; use format: huggingface`."""
    kinds = Counter(posixpath.splitext(p)[1].lower() or posixpath.basename(p) for p in paths)
    found = ", ".join(f"{n} {ext} file{'s' if n > 1 else ''}" for ext, n in kinds.most_common(4))
    looks = [("lance", any(p.endswith(".manifest") and "/_versions/" in p for p in paths), "a Lance dataset"),
             ("huggingface", any(p.lower().endswith(".arrow") for p in paths), "a Dataset.save_to_disk folder"),
             ("parquet", any(p.lower().endswith(".parquet") for p in paths), "parquet files"),
             ("webdataset", any(is_shard(p) for p in paths), "WebDataset shards"),
             ("imagefolder", any(posixpath.splitext(p)[1].lower()[1:] in IMAGE_EXTENSIONS for p in paths),
              "image files")]
    hint = next((f": {what}; use format: {other}" for other, seen, what in looks if seen and other != fmt), "")
    return f"found {found}{hint}"


def observe_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the source is right now, without reading its contents: fragments, files, bytes, a
    fingerprint (names and sizes, or the Lance version) that changes when the source does, and its
    records where telling them reads no image (`prx_core.sources.row_counts`; None otherwise)."""
    from prx_core.sources.row_counts import source_rows

    if spec.format == "imagefolder":  # one walk, one record per folder: never a whole-tree find
        if not filesystem_for(spec.uri, storage_options).exists(spec.uri):
            raise FileNotFoundError(f"source {spec.name!r}: {spec.uri} does not exist")
        folders = walk_folders(spec.uri, storage_options)
        fragments = len(fragments_of(folders))
        entries = fingerprint_lines(folders)
        files, size = sum(f.files for f in folders), sum(f.bytes for f in folders)
        rows = source_rows(spec, [], storage_options, images=sum(f.image_files for f in folders))
    elif spec.format == "lance":
        import lance

        fragments = len(list_fragments(spec, storage_options))
        dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
        entries = [f"lance@{dataset.version}"]
        files, size = len(dataset.get_fragments()), 0
        rows = source_rows(spec, [], storage_options)
    else:  # data files: one per fragment, thousands at most
        sizes = fragment_sizes(spec, storage_options)
        fragments = len(sizes)
        fs = filesystem_for(spec.uri, storage_options)
        details = fs.find(spec.uri, detail=True) if not fs.isfile(spec.uri) else {spec.uri: fs.info(spec.uri)}
        entries = sorted(f"{name}\t{info.get('size', 0)}" for name, info in details.items())
        entries = [printable_name(e) for e in entries]  # a non-UTF-8 file name must not fail the hash
        files, size = len(entries), sum(int(info.get("size") or 0) for info in details.values())
        rows = source_rows(spec, sizes, storage_options)
    digest = hashlib.sha256("\n".join([spec.format, *entries]).encode()).hexdigest()[:16]
    return {"fragments": fragments, "files": files, "bytes": size, "fingerprint": digest, "rows": rows}
