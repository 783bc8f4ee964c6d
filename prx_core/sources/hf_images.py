"""Image columns of table sources: raw bytes, or a Hugging Face `Image()` feature.

A `datasets` `Image()` column is stored as `struct<bytes: binary, path: string>`: the bytes when
the dataset embeds them (`to_parquet` of an in-memory dataset, the Hub's parquet), else a path:
an absolute local path (`load_dataset("imagefolder")` exported with `to_parquet` keeps the
original files' paths), one relative to the data file, or a URL / S3 key. Sources are untrusted
(docs/security.md): a local or same-store path is read only when it resolves under the source
root (`spec.uri`), never through a FIFO, and never past `spec.max_image_bytes`.
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from prx_core.image.decode import EMPTY
from prx_core.sources.folders.reader import read_bounded, read_local
from prx_core.sources.records import IMAGE_TOO_LARGE, PATH_OUTSIDE_SOURCE, UNREADABLE_FILE
from prx_core.store.storage import filesystem_for, is_remote

FETCHED_SCHEMES = ("http://", "https://", "s3://")  # handed to the downloader (`prx_core.sources.fetch.download`)
REMOTE_READS = 16  # ranged reads of one batch's paths in flight (an object store's latency, not its bandwidth)


def is_image_struct(kind: pa.DataType) -> bool:
    """An HF `Image()` column: a struct with a binary `bytes` field (and, normally, a `path`)."""
    if not pa.types.is_struct(kind):
        return False
    names = {kind.field(i).name: kind.field(i).type for i in range(kind.num_fields)}
    return "bytes" in names and (pa.types.is_binary(names["bytes"]) or pa.types.is_large_binary(names["bytes"]))


def image_bytes(spec: Any, column: pa.Array | pa.ChunkedArray, rows: Any, where: Any) -> None:
    """Fill `rows.images` from an image column of `where`'s batch: a binary column as it is; an HF
    `Image()` struct as its `bytes` when non-null, else from its `path`. A path that is a URL
    (http(s)://, s3://) sets `rows.urls[i]` and leaves `rows.images[i]` None: the caller
    (`tables._fill_images`) then hands the row to the downloader. Any other path is read here
    (see `read_paths`); a row with neither bytes nor path is an `empty` reject that says so."""
    if not pa.types.is_struct(column.type):
        rows.images = column.cast(pa.large_binary()).to_pylist()
        return
    if not is_image_struct(column.type):
        raise TypeError(f"source {spec.name!r}: image column {spec.image_column!r} of {where.path} is "
                        f"{column.type}: expected image bytes or a Hugging Face Image() struct<bytes, path>")
    live = set(rows.live())
    paths: dict[int, str] = {}
    for i, value in enumerate(column.to_pylist()):
        data, path = (value or {}).get("bytes"), (value or {}).get("path")
        if data is not None:
            rows.images[i] = data
        elif i not in live:
            continue
        elif not path:
            rows.refuse(i, EMPTY, f"the Image() column {spec.image_column!r} holds neither bytes nor a path")
        elif path[:8].lower().startswith(FETCHED_SCHEMES):
            rows.urls[i] = path
        else:
            paths[i] = path
    if paths:
        read_paths(spec, paths, rows, where)


def read_paths(spec: Any, paths: dict[int, str], rows: Any, where: Any) -> None:
    """Read the rows' image files: a relative path is relative to the data file's folder; a path
    resolving outside the source root is a `path_outside_source` reject, a missing or unreadable
    file an `unreadable_file` reject naming it, a bigger one than the limit `image_too_large`."""
    remote = is_remote(spec.uri)
    folder = where.path if spec.format == "lance" else posixpath.dirname(where.path)  # a Lance uri is a folder
    root = source_root(spec, where, remote)
    resolved = {i: resolve(spec.uri, folder, root, p, remote) for i, p in paths.items()}
    for i, found in resolved.items():
        if isinstance(found, tuple):
            rows.refuse(i, *found)
    wanted = {i: p for i, p in resolved.items() if isinstance(p, str)}
    if remote:
        fs = filesystem_for(spec.uri, where.storage_options)
        with ThreadPoolExecutor(min(REMOTE_READS, max(1, len(wanted)))) as pool:
            results = dict(zip(wanted, pool.map(lambda p: read_remote(fs, p, spec.max_image_bytes), wanted.values())))
    else:
        results = {i: read_file(p, spec.max_image_bytes) for i, p in wanted.items()}
    for i, result in results.items():
        if isinstance(result, tuple):
            rows.refuse(i, *result)
        else:
            rows.images[i] = result


def source_root(spec: Any, where: Any, remote: bool) -> str:
    """The folder no image path may leave: the source's `uri`, or its folder when `uri` is the one
    data file (links resolved for a local root; a remote one without its scheme)."""
    one_file = where.path == spec.uri and spec.format != "lance"
    if remote:
        root = posixpath.normpath(spec.uri.split("://", 1)[1])
        return posixpath.dirname(root) if one_file else root
    return os.path.realpath(os.path.dirname(spec.uri) if one_file or os.path.isfile(spec.uri) else spec.uri)


def resolve(uri: str, folder: str, root: str, path: str, remote: bool) -> str | tuple[str, str]:
    """The full path or URI of an image `path` found in a file of `folder`, or (reason, message)."""
    shown = path if len(path) <= 120 else f"{path[:117]}..."
    if "\x00" in path:
        return UNREADABLE_FILE, f"image path {shown!r} holds a NUL character"
    if "://" in path or "::" in path:
        return UNREADABLE_FILE, (f"image path {shown!r}: its scheme is not read (an Image() path is read when it is "
                                 "relative to the data file, under the source root, http(s):// or s3://)")
    if remote:
        scheme, rest = folder.split("://", 1)
        full = posixpath.normpath(posixpath.join(rest, path))  # an absolute path is no key of this store
        inside = not path.startswith("/") and full.startswith(root.rstrip("/") + "/")
        return f"{scheme}://{full}" if inside else (PATH_OUTSIDE_SOURCE, outside(shown, uri))
    full = os.path.realpath(os.path.join(folder, path))  # links resolved: a link out of the root is outside
    if not full.startswith(root.rstrip(os.sep) + os.sep):
        return PATH_OUTSIDE_SOURCE, outside(shown, uri)
    return full


def outside(path: str, root: str) -> str:
    return (f"image path {path!r} resolves outside the source root {root!r}: not read (a source reads no file "
            "outside its uri; embed the images' bytes in the table, or keep the files under the root)")


def read_file(path: str, limit: int) -> bytes | tuple[str, str]:
    """A local image file (resolved, under the root): bounded, never a FIFO or a device."""
    return read_bounded(lambda: read_local(path, limit + 1), limit, f"image file {path!r}", IMAGE_TOO_LARGE)


def read_remote(fs: Any, uri: str, limit: int) -> bytes | tuple[str, str]:
    """An object of the source's store, by a ranged read: a bigger object stays bounded."""
    try:
        data = fs.cat_file(uri, start=0, end=limit + 1)
    except (OSError, ValueError) as exc:
        return UNREADABLE_FILE, f"image file {uri!r}: {type(exc).__name__}: {exc}"
    return (IMAGE_TOO_LARGE, f"image file {uri!r} has more than {limit} bytes, the source's limit") \
        if len(data) > limit else data
