"""Stage `caption_embeddings`: vectors for the explorer's nearest-neighbour search.

Two tables, each with a cosine vector index `embedding_vector` on `embedding`:
- `caption_embeddings`: MiniLM vectors of captions, keyed by (content_id, captioner version,
  embedder version) and shared by sources like `caption_labels`. Only captions of the source's
  eligible contents not yet embedded for that pair are embedded (a Ray Data actor pool, one
  model per actor), then upserted: a new captioner or embedder re-embeds, a rerun reuses.
- `source_embeddings`: the source's own vectors (its CLIP column, kept in `samples`) for every
  sample of the partition, as a fixed-size column, replaced per source in one commit. The table's
  width is the first source's; a source of another width is reported and not written. Null,
  empty, other-length or non-finite vectors are skipped and counted.
A rerun embeds nothing and commits nothing: the partition is compared by digest before writing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from prx_core.compute.parallel import Progress, quiet_ray_data
from prx_core.models.embeddings import EmbedBatch, EmbedderConfig
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.lookups import pending_captions
from prx_core.store.maintenance import IndexReport, VectorIndexCoverage
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

EMBEDDING_KEYS = ["content_id", "captioner_version", "embedder_version"]
VECTOR_COLUMN = "embedding"
TABLES = ("caption_embeddings", "source_embeddings")
COMMIT_EVERY = 50_000  # captions per upsert: a crash loses at most this much work
ROWS_PER_SCAN = 8192


@dataclass
class CaptionEmbeddingsReport:
    source: str
    captioned: int  # eligible contents with a caption
    reused: int  # of those, already embedded for (captioner, embedder)
    embedded: int
    seconds: float = 0.0
    embedding_seconds: float = 0.0  # wall time of the Ray pipeline (actor start and model load included)
    covered: int = 0  # captioned eligible contents with an embedding after the run
    source_rows: int = 0  # rows of the source in `source_embeddings` after the run
    skipped: int = 0  # samples whose source vector is null, empty, of another length or not finite
    source_dim: int | None = None  # the most common length of the source's vectors
    dim_mismatch: str | None = None  # why nothing was written for the source
    source_written: bool = False  # False when the partition was already identical (or mismatched)
    caption_embeddings_version: int | None = None
    source_embeddings_version: int | None = None
    read_versions: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, IndexReport] = field(default_factory=dict)
    coverage: dict[str, VectorIndexCoverage] = field(default_factory=dict)

    @property
    def embeddings_per_second(self) -> float:
        return self.embedded / max(self.embedding_seconds, 1e-9)


def embedded_keys(storage: Storage, captioner_version: str, embedder_version: str) -> pa.Array:
    """content_ids already embedded for this (captioner, embedder) pair."""
    dataset = lance_io.open_table(storage.lance_uri("caption_embeddings"), storage.lance_storage_options())
    if dataset is None:
        return pa.array([], pa.string())
    where = (f"captioner_version = {lance_io.sql_literal(captioner_version)} "
             f"AND embedder_version = {lance_io.sql_literal(embedder_version)}")
    return dataset.to_table(columns=["content_id"], filter=where)["content_id"].combine_chunks()


def build_caption_embeddings(
    source: str, storage: Storage, captioner_version: str, config: EmbedderConfig, *, actors: int = 1,
    progress: Progress | None = None, commit_every: int = COMMIT_EVERY,
) -> CaptionEmbeddingsReport:
    """Embed what is missing, refresh the source's vectors, then catch both vector indexes up."""
    start = time.monotonic()
    options = storage.lance_storage_options()
    done = embedded_keys(storage, captioner_version, config.version())
    captions, todo, versions = pending_captions(source, storage, captioner_version, done)
    report = CaptionEmbeddingsReport(source, captions.num_rows, captions.num_rows - todo.num_rows, todo.num_rows,
                                     read_versions=versions)
    if todo.num_rows:
        started = time.monotonic()
        embed_and_upsert(todo, storage, captioner_version, config, actors, commit_every, progress)
        report.embedding_seconds = time.monotonic() - started
    write_source_embeddings(source, storage, versions["samples"], report)
    for table in TABLES:
        uri = storage.lance_uri(table)
        if lance_io.table_exists(uri, options):
            report.indexes[table] = maintenance.refresh_table_indexes(uri, table, options)
            report.coverage[table] = maintenance.vector_index_coverage(uri, VECTOR_COLUMN, options)
    report.caption_embeddings_version = lance_io.table_version(storage.lance_uri("caption_embeddings"), options)
    report.source_embeddings_version = lance_io.table_version(storage.lance_uri("source_embeddings"), options)
    after = embedded_keys(storage, captioner_version, config.version())
    report.covered = int(pc.sum(pc.is_in(captions["content_id"], after)).as_py() or 0)
    report.seconds = time.monotonic() - start
    return report


def embed_and_upsert(todo: pa.Table, storage: Storage, captioner_version: str, config: EmbedderConfig, actors: int,
                     commit_every: int, progress: Progress | None) -> None:
    import ray.data

    quiet_ray_data()
    uri, options = storage.lance_uri("caption_embeddings"), storage.lance_storage_options()
    dataset = ray.data.from_arrow(todo.select(["content_id", "caption"])).map_batches(
        EmbedBatch, fn_constructor_kwargs={"config": config}, compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=config.batch_size, batch_format="numpy",
    )

    def rows() -> Iterator[pa.Table]:
        done = 0
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            table = to_embedding_rows(batch, captioner_version, config.dim)
            done += table.num_rows
            if progress is not None:
                progress(done, todo.num_rows)
            yield table

    lance_io.upsert_stream(uri, rows(), EMBEDDING_KEYS, options, commit_every)


def to_embedding_rows(batch: dict[str, np.ndarray], captioner_version: str, dim: int) -> pa.Table:
    vectors = np.ascontiguousarray(np.asarray(batch["embedding"], dtype=np.float32).reshape(-1, dim))
    n = len(vectors)
    return pa.table({
        "content_id": pa.array([str(c) for c in batch["content_id"]], pa.string()),
        "captioner_version": pa.array([captioner_version] * n, pa.string()),
        "embedder_version": pa.array([str(v) for v in batch["embedder_version"]], pa.string()),
        "embedder_id": pa.array([str(v) for v in batch["embedder_id"]], pa.string()),
        "embedding": fixed_size_vectors(vectors),
    }, schema=schemas.CAPTION_EMBEDDINGS)


def fixed_size_vectors(vectors: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), vectors.shape[1])


# -- source embeddings ---------------------------------------------------------------------------------

@dataclass
class _LengthStats:
    rows: int = 0  # vectors of this length
    usable: int = 0  # of those, finite
    digest: int = 0  # order-independent sum of row hashes of the usable ones


def usable_vectors(embeddings: pa.Array, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Mask of the rows holding a finite `dim`-long vector, and those vectors as (n, dim) float32."""
    lengths = pc.list_value_length(embeddings).fill_null(0).to_numpy(zero_copy_only=False)
    mask = lengths == dim
    flat = pc.list_flatten(embeddings.filter(pa.array(mask))).to_numpy(zero_copy_only=False)
    values = np.asarray(flat, dtype=np.float32).reshape(-1, dim)
    finite = np.isfinite(values).all(axis=1)
    mask[np.flatnonzero(mask)[~finite]] = False
    return mask, np.ascontiguousarray(values[finite])


def row_digest(sample_ids: list[str], content_ids: list[str], values: np.ndarray) -> int:
    return sum(xxhash.xxh3_64_intdigest(f"{s}\0{c}\0".encode() + v.tobytes())
               for s, c, v in zip(sample_ids, content_ids, values)) % (1 << 64)


def scan_vectors(uri: str, source: str, options: dict[str, str], version: int | None = None) -> Iterator[pa.RecordBatch]:
    dataset = lance_io.require_table(uri, options)
    if version is not None:
        dataset = dataset.checkout_version(version)
    yield from dataset.to_batches(columns=["sample_id", "content_id", "embedding"], filter=source_predicate(source),
                                  batch_size=ROWS_PER_SCAN)


def length_stats(batches: Iterator[pa.RecordBatch]) -> tuple[int, dict[int, _LengthStats]]:
    """Rows seen, and per vector length (> 0): how many, how many usable, their digest."""
    total, stats = 0, {}
    for batch in batches:
        total += batch.num_rows
        lengths = Counter(pc.list_value_length(batch["embedding"]).fill_null(0).to_pylist())
        for dim, count in lengths.items():
            if dim <= 0:
                continue
            mask, values = usable_vectors(batch["embedding"], dim)
            entry = stats.setdefault(dim, _LengthStats())
            entry.rows += count
            entry.usable += int(mask.sum())
            entry.digest = (entry.digest + row_digest(batch["sample_id"].filter(mask).to_pylist(),
                                                      batch["content_id"].filter(mask).to_pylist(), values)) % (1 << 64)
    return total, stats


def write_source_embeddings(source: str, storage: Storage, samples_version: int, report: CaptionEmbeddingsReport) -> None:
    """Replace the source's rows of `source_embeddings` unless identical or of another width."""
    options = storage.lance_storage_options()
    samples_uri, uri = storage.lance_uri("samples"), storage.lance_uri("source_embeddings")
    total, stats = length_stats(scan_vectors(samples_uri, source, options, samples_version))
    dim = max(stats, key=lambda d: (stats[d].rows, -d)) if stats else None  # most common, then narrowest
    want = stats[dim] if dim else _LengthStats()
    report.source_dim, report.skipped = dim, total - want.usable
    table_dim = _table_dim(uri, options)
    if dim is not None and table_dim is not None and dim != table_dim:
        _mismatch(report, source, dim, table_dim, total)
    elif table_dim is not None or dim is not None:
        width = table_dim or dim
        have = length_stats(scan_vectors(uri, source, options))[1].get(width, _LengthStats()) if table_dim else _LengthStats()
        if (have.usable, have.digest) != (want.usable, want.digest):
            schema = schemas.source_embeddings_schema(width)
            fragments = lance_io.write_fragments(
                uri, source_rows(source, scan_vectors(samples_uri, source, options, samples_version), width, schema),
                schema, options) if dim else []
            try:
                lance_io.replace_rows(uri, source_predicate(source), fragments, schema, options)
                report.source_written = True
            except ValueError:  # another source created the table first, with another width
                if (raced := _table_dim(uri, options)) in (None, width):
                    raise
                _mismatch(report, source, width, raced, total)
    if lance_io.table_exists(uri, options):
        report.source_rows = lance_io.require_table(uri, options).count_rows(source_predicate(source))


def _table_dim(uri: str, options: dict[str, str]) -> int | None:
    table = lance_io.open_table(uri, options)
    return None if table is None else table.schema.field("embedding").type.list_size


def _mismatch(report: CaptionEmbeddingsReport, source: str, dim: int, table_dim: int, total: int) -> None:
    report.dim_mismatch = (f"source {source} has {dim}-d embeddings but source_embeddings holds {table_dim}-d "
                           "vectors: nothing written for this source")
    report.skipped = total


def source_rows(source: str, batches: Iterator[pa.RecordBatch], dim: int, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        mask, values = usable_vectors(batch["embedding"], dim)
        if not mask.any():
            continue
        keep = pa.array(mask)
        yield pa.RecordBatch.from_arrays(
            [batch["sample_id"].filter(keep), pa.array([source] * len(values), pa.string()),
             batch["content_id"].filter(keep), fixed_size_vectors(values)], schema=schema)
