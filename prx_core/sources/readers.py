"""Readers for the catalog's source formats, all yielding one Arrow schema.

A source is split into fragments (parquet files, tar shards, chunks of an image folder, Lance
fragments) so that Ray tasks can read them in parallel; each fragment streams Arrow record
batches of `RECORD_SCHEMA`. Local paths and s3:// URIs go through the same fsspec layer.
Nothing is dropped here: a WebDataset sample without an image member comes through with
empty image bytes, so decoding rejects it with a reason instead of losing it silently.
"""

from __future__ import annotations

import hashlib
import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.sources.catalog import SourceSpec
from prx_core.store.storage import filesystem_for, is_remote, lance_storage_options

RECORD_SCHEMA = pa.schema(
    [
        ("source_key", pa.string()),
        ("image", pa.large_binary()),
        ("caption", pa.string()),
        ("embedding", pa.list_(pa.float32())),
    ]
)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
CAPTION_EXTENSIONS = ("txt", "caption")
BATCH_ROWS = 256


def list_fragments(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Stable, sorted fragment ids of a source: the unit of parallel reading."""
    return [fragment for fragment, _ in fragment_sizes(spec, storage_options)]


def fragment_sizes(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    """(fragment id, bytes) in id order: parquet files, tar shards, Lance fragments, or the
    folders of an image folder (each folder's files are listed by the worker that reads it, so the
    driver holds one entry per folder, never one per image)."""
    if spec.format == "lance":
        import lance

        dataset = lance.dataset(spec.uri, storage_options=_lance_options(spec.uri, storage_options))
        return [(str(f.fragment_id), sum(int(d.file_size_bytes or 0) for d in f.metadata.files))
                for f in sorted(dataset.get_fragments(), key=lambda f: f.fragment_id)]
    fs = filesystem_for(spec.uri, storage_options)
    if not fs.exists(spec.uri):  # an empty listing would otherwise ingest nothing, silently
        raise FileNotFoundError(f"source {spec.name!r}: {spec.uri} does not exist")
    if spec.format == "parquet":
        return _glob_sizes(fs, spec.uri, ("parquet",))
    if spec.format == "webdataset":
        return _glob_sizes(fs, spec.uri, ("tar",))
    if spec.format == "imagefolder":
        return _folders(fs, spec.uri)
    raise ValueError(f"unknown source format {spec.format!r}")


def read_fragment(
    spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None = None
) -> Iterator[pa.RecordBatch]:
    """Stream one fragment as record batches of `RECORD_SCHEMA`."""
    readers = {"parquet": _read_parquet, "webdataset": _read_webdataset, "imagefolder": _read_folder, "lance": _read_lance}
    yield from readers[spec.format](spec, fragment, storage_options)


def read_source(spec: SourceSpec, storage_options: dict[str, Any] | None = None) -> Iterator[pa.RecordBatch]:
    for fragment in list_fragments(spec, storage_options):
        yield from read_fragment(spec, fragment, storage_options)


def _glob(fs: Any, uri: str, extensions: tuple[str, ...]) -> list[str]:
    """Files under `uri` (or `uri` itself) with one of `extensions`, sorted, as full URIs."""
    return [path for path, _ in _glob_sizes(fs, uri, extensions)]


def _glob_sizes(fs: Any, uri: str, extensions: tuple[str, ...]) -> list[tuple[str, int]]:
    prefix = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
    if fs.isfile(uri):
        return [(uri, int(fs.info(uri).get("size") or 0))]
    found = fs.find(uri, detail=True)
    return sorted((prefix + p if prefix and not p.startswith(prefix) else p, int(info.get("size") or 0))
                  for p, info in found.items() if p.rsplit(".", 1)[-1].lower() in extensions)


def _folders(fs: Any, uri: str) -> list[tuple[str, int]]:
    """Every folder under `uri` (itself included) holding image files, with the bytes of its
    images; one listing per folder, so memory holds one folder's entries at a time."""
    prefix = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
    out, todo = [], [uri]
    while todo:
        folder = todo.pop()
        images = 0
        for entry in fs.ls(folder, detail=True):
            name = entry["name"]
            if entry["type"] == "directory":
                todo.append(prefix + name if prefix and not name.startswith(prefix) else name)
            elif name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS:
                images += int(entry.get("size") or 0) or 1
        if images:
            out.append((folder, images))
    return sorted(out)


def _batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(rows, schema=RECORD_SCHEMA)


def _read_parquet(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    columns = [c for c in (spec.image_column, spec.caption_column, spec.key_column, spec.embedding_column) if c]
    fs = filesystem_for(path, storage_options)
    stem = posixpath.splitext(posixpath.basename(path))[0]
    row = 0
    with fs.open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        missing = [c for c in columns if c not in parquet.schema_arrow.names]
        if missing:
            raise KeyError(f"source {spec.name!r}: {path} has no column(s) {missing} (has {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield _normalize(spec, batch, stem, row)
            row += batch.num_rows


def _read_lance(spec: SourceSpec, fragment: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    import lance

    dataset = lance.dataset(spec.uri, storage_options=_lance_options(spec.uri, storage_options))
    columns = [c for c in (spec.image_column, spec.caption_column, spec.key_column, spec.embedding_column) if c]
    row = 0
    for batch in dataset.get_fragment(int(fragment)).to_batches(columns=columns, batch_size=BATCH_ROWS):
        yield _normalize(spec, batch, f"fragment{fragment}", row)
        row += batch.num_rows


def _normalize(spec: SourceSpec, batch: pa.RecordBatch, stem: str, first_row: int) -> pa.RecordBatch:
    """Map a table source's columns onto `RECORD_SCHEMA`; default key: `<file>:<row>`."""
    n = batch.num_rows
    if spec.key_column:
        keys = batch.column(spec.key_column).cast(pa.string())
    else:
        keys = pa.array([f"{stem}:{first_row + i}" for i in range(n)], pa.string())
    images = batch.column(spec.image_column).cast(pa.large_binary())
    captions = batch.column(spec.caption_column).cast(pa.string()) if spec.caption_column else pa.nulls(n, pa.string())
    if spec.embedding_column:
        embeddings = batch.column(spec.embedding_column).cast(pa.list_(pa.float32()))
    else:
        embeddings = pa.nulls(n, pa.list_(pa.float32()))
    return pa.RecordBatch.from_arrays([keys, images, captions, embeddings], schema=RECORD_SCHEMA)


def _read_webdataset(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    """Members `<key>.<ext>` grouped by key in archive order; the first image member wins."""
    fs = filesystem_for(path, storage_options)
    rows: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    with fs.open(path, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = posixpath.basename(member.name)
            key, _, ext = base.partition(".")
            key = posixpath.join(posixpath.dirname(member.name), key)
            if current is None or current["source_key"] != key:
                if current is not None:
                    rows.append(current)
                current = {"source_key": key, "image": b"", "caption": None, "embedding": None}
            payload = tar.extractfile(member).read()
            ext = ext.lower()
            if ext in IMAGE_EXTENSIONS and not current["image"]:
                current["image"] = payload
            elif ext in CAPTION_EXTENSIONS and current["caption"] is None:
                current["caption"] = payload.decode("utf-8", errors="replace").strip()
            if len(rows) >= BATCH_ROWS:
                yield _batch(rows)
                rows = []
    if current is not None:
        rows.append(current)
    if rows:
        yield _batch(rows)


def _folder_pairs(fs: Any, folder: str) -> list[tuple[str, str | None]]:
    """(image, sidecar caption or None) for every image directly in `folder`, from one listing of
    it: a LIST per folder, never a HEAD per image (what makes object stores slow)."""
    prefix = folder.split("://", 1)[0] + "://" if is_remote(folder) else ""
    names = [entry["name"] for entry in fs.ls(folder, detail=True) if entry["type"] == "file"]
    listing = sorted(prefix + p if prefix and not p.startswith(prefix) else p for p in names)
    sidecars = {p for p in listing if p.rsplit(".", 1)[-1].lower() in CAPTION_EXTENSIONS}
    pairs = []
    for path in listing:
        if path.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS:
            stem = posixpath.splitext(path)[0]
            pairs.append((path, next((f"{stem}.{e}" for e in CAPTION_EXTENSIONS if f"{stem}.{e}" in sidecars), None)))
    return pairs


def _read_folder(spec: SourceSpec, folder: str, storage_options: dict[str, Any] | None) -> Iterator[pa.RecordBatch]:
    """Image files of one folder with sidecar `<stem>.txt` captions; key = path relative to the
    source root, no extension."""
    fs = filesystem_for(spec.uri, storage_options)
    root = spec.uri.split("://", 1)[-1].rstrip("/")
    rows: list[dict[str, Any]] = []
    for path, sidecar in _folder_pairs(fs, folder):
        caption = fs.cat_file(sidecar).decode("utf-8", errors="replace").strip() if sidecar else None
        key = posixpath.relpath(posixpath.splitext(path.split("://", 1)[-1])[0], root)
        rows.append({"source_key": key, "image": fs.cat_file(path), "caption": caption, "embedding": None})
        if len(rows) >= BATCH_ROWS:
            yield _batch(rows)
            rows = []
    if rows:
        yield _batch(rows)


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
        files, size = len(entries), sum(int(info.get("size") or 0) for info in details.values())
    digest = hashlib.sha256("\n".join([spec.format, *entries]).encode()).hexdigest()[:16]
    return {"fragments": len(fragments), "files": files, "bytes": size, "fingerprint": digest}
