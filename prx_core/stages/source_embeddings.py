"""`source_embeddings`: the source's own vectors (its CLIP column, kept in `samples`) for every
sample of the partition, as a fixed-size column, replaced per source in one commit.

The table's width is the first source's; a source of another width is reported and not written.
Null, empty, other-length or non-finite vectors are skipped and counted. Work runs as row units on
Ray workers in three phases of one attempt: `lengths` (per unit: rows of each vector length, how
many are usable, an order-independent digest), `stored` (the same over the partition's current
rows in `source_embeddings`), then, only when the two digests differ, `write` (fragments of the
usable vectors of the chosen width). A rerun on unchanged input writes and commits nothing.
`caption_embeddings` runs it (`write_source_embeddings`) on the `samples` version it pinned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units, scan_row_unit
from prx_core.compute.units import Unit, UnitRun
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import source_predicate, unit_outputs
from prx_core.store.storage import Storage

UNIT_ROWS = 200_000  # vectors of ~2 KB: a unit reads ~400 MB in batches and writes one fragment
ROWS_PER_SCAN = 8192
DIGEST = 1 << 64


@dataclass
class SourceEmbeddings:
    rows: int = 0  # rows of the source in `source_embeddings` after the run
    skipped: int = 0  # samples whose source vector is null, empty, of another length or not finite
    dim: int | None = None  # the most common length of the source's vectors
    mismatch: str | None = None  # why nothing was written for the source
    written: bool = False  # False when the partition was already identical (or mismatched)


def fixed_size_vectors(vectors: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), vectors.shape[1])


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
               for s, c, v in zip(sample_ids, content_ids, values)) % DIGEST


def length_stats(batches: Iterator[pa.RecordBatch]) -> dict[str, Any]:
    """Rows seen, and per vector length (> 0): [rows, usable rows, digest of the usable ones]."""
    total, stats = 0, {}
    for batch in batches:
        total += batch.num_rows
        for dim, count in Counter(pc.list_value_length(batch["embedding"]).fill_null(0).to_pylist()).items():
            if dim <= 0:
                continue
            mask, values = usable_vectors(batch["embedding"], dim)
            entry = stats.setdefault(str(dim), [0, 0, 0])
            digest = row_digest(batch["sample_id"].filter(mask).to_pylist(), batch["content_id"].filter(mask).to_pylist(),
                                values)
            stats[str(dim)] = [entry[0] + count, entry[1] + int(mask.sum()), (entry[2] + digest) % DIGEST]
    return {"rows": total, "lengths": stats}


def merged_lengths(summaries: list[dict[str, Any]]) -> dict[int, list[int]]:
    merged: dict[int, list[int]] = {}
    for summary in summaries:
        for dim, (rows, usable, digest) in summary["lengths"].items():
            entry = merged.setdefault(int(dim), [0, 0, 0])
            merged[int(dim)] = [entry[0] + rows, entry[1] + usable, (entry[2] + digest) % DIGEST]
    return merged


def _scan(run: UnitRun, table: str, unit: Unit) -> Iterator[pa.RecordBatch]:
    yield from scan_row_unit(run.storage.lance_uri(table), run.manifest.inputs[table], unit.spec["range"],
                             ["sample_id", "content_id", "embedding"], source_predicate(run.manifest.partition),
                             run.storage.lance_storage_options(), batch_size=ROWS_PER_SCAN)


def lengths_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    return length_stats(_scan(run, unit.spec["table"], unit))


def write_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Fragments of the unit's usable vectors of the chosen width (no commit)."""
    source, dim = run.manifest.partition, unit.spec["dim"]
    schema = schemas.source_embeddings_schema(dim)

    def rows() -> Iterator[pa.RecordBatch]:
        for batch in _scan(run, "samples", unit):
            mask, values = usable_vectors(batch["embedding"], dim)
            if mask.any():
                keep = pa.array(mask)
                yield pa.RecordBatch.from_arrays(
                    [batch["sample_id"].filter(keep), pa.array([source] * len(values), pa.string()),
                     batch["content_id"].filter(keep), fixed_size_vectors(values)], schema=schema)

    options = run.storage.lance_storage_options()
    written = lance_io.write_fragments(run.storage.lance_uri("source_embeddings"), rows(), schema, options)
    return {"rows": unit.rows, **unit_outputs(run.storage, "source_embeddings", written, [])}


def _units(prefix: str, table: str, units: list[Unit], **extra: Any) -> list[Unit]:
    return [Unit(f"{prefix}-{u.id}", u.rows, {"table": table, "range": dict(u.spec), **extra}) for u in units]


def table_dim(uri: str, options: dict[str, str] | None) -> int | None:
    table = lance_io.open_table(uri, options)
    return None if table is None else table.schema.field("embedding").type.list_size


def pin_source_embeddings(run: StageRun[SourceEmbeddingsSettings]) -> dict[str, int | None]:
    """The given `samples` version (the one `caption_embeddings` pinned) planned into units, and
    the table's version and width."""
    options = run.storage.lance_storage_options()
    uri = run.storage.lance_uri("source_embeddings")
    _, run.state["units"] = plan_row_units(run.storage.lance_uri("samples"), source_predicate(run.partition),
                                           run.settings.unit_rows, options, run.settings.samples_version)
    run.state["width"] = table_dim(uri, options)
    return {"samples": run.settings.samples_version, "source_embeddings": lance_io.table_version(uri, options)}


def measure_and_write(run: StageRun[SourceEmbeddingsSettings]) -> None:
    """`lengths` of the source's vectors; unless the width mismatches, `stored` (the partition's
    current rows) and, when the two differ, `write` (`run.state["replace"]`: the commit is due)."""
    units, width, source = run.state["units"], run.state["width"], run.partition
    wanted = run.units("lengths", _units("lengths", "samples", units), lengths_unit)
    stats, total = merged_lengths(wanted.summaries), run.state.setdefault("total", wanted.total("rows"))
    dim = max(stats, key=lambda d: (stats[d][0], -d)) if stats else None  # most common, then narrowest
    report = run.state["report"] = SourceEmbeddings(dim=dim, skipped=total - (stats[dim][1] if dim else 0))
    if dim is not None and width is not None and dim != width:
        _mismatch(report, source, dim, width, total)
        return
    if width is None and dim is None:
        return
    width = run.state["width"] = width or dim
    have = [0, 0, 0]
    if run.inputs["source_embeddings"] is not None:
        options = run.storage.lance_storage_options()
        _, stored_units = plan_row_units(run.storage.lance_uri("source_embeddings"), source_predicate(source),
                                         run.settings.unit_rows, options, run.inputs["source_embeddings"])
        stored = run.units("stored", _units("stored", "source_embeddings", stored_units), lengths_unit, progress=False)
        have = merged_lengths(stored.summaries).get(width, have)
    want = stats.get(width, [0, 0, 0])
    run.state["replace"] = (have[1], have[2]) != (want[1], want[2])
    if run.state["replace"] and dim:
        run.units("write", _units("write", "samples", units, dim=width), write_unit)


def commit_source_embeddings(run: StageRun[SourceEmbeddingsSettings]) -> dict[str, int | None]:
    """Replace the source's rows in one commit when they changed (a source of another width is not written)."""
    uri, options = run.storage.lance_uri("source_embeddings"), run.storage.lance_storage_options()
    if run.state.get("replace"):
        width, report = run.state["width"], run.state["report"]
        written = run.results.get("write")
        summaries = written.summaries if written else []
        fragments = lance_io.fragments_from_json(f for s in summaries for f in s["fragments"])
        try:
            lance_io.replace_rows(uri, source_predicate(run.partition), fragments,
                                  schemas.source_embeddings_schema(width), options)
            report.written = True
        except ValueError:  # another source created the table first, with another width
            if (raced := table_dim(uri, options)) in (None, width):
                raise
            _mismatch(report, run.partition, width, raced, run.state["total"])
    return {"source_embeddings": lance_io.table_version(uri, options)}


def report_source_embeddings(run: StageRun[SourceEmbeddingsSettings]) -> SourceEmbeddings:
    report: SourceEmbeddings = run.state["report"]
    uri, options = run.storage.lance_uri("source_embeddings"), run.storage.lance_storage_options()
    if run.state.get("width") is not None and report.mismatch is None and lance_io.table_exists(uri, options):
        report.rows = lance_io.require_table(uri, options).count_rows(source_predicate(run.partition))
    return report


def _mismatch(report: SourceEmbeddings, source: str, dim: int, width: int, total: int) -> None:
    report.mismatch = (f"source {source} has {dim}-d embeddings but source_embeddings holds {width}-d "
                       "vectors: nothing written for this source")
    report.skipped = total


@dataclass(frozen=True, kw_only=True)
class SourceEmbeddingsSettings(Settings):
    """The `source_embeddings` settings: the `samples` version it reads (pinned as that input), rows per unit."""

    samples_version: int
    unit_rows: int = UNIT_ROWS


SOURCE_EMBEDDINGS: Stage[SourceEmbeddingsSettings] = Stage(
    "source_embeddings", reads=("samples",), writes=("source_embeddings",), code_version="1",
    report_type=SourceEmbeddings, settings=SourceEmbeddingsSettings,
    unit_sizes=(UnitSize("unit_rows", "Rows per `source_embeddings` unit (vectors of ~2 KB)."),),
    unpinned=("samples_version",),  # pinned as the `samples` input
    phases=("lengths", "stored", "write"), pin=pin_source_embeddings, work=measure_and_write,
    commit=commit_source_embeddings, report=report_source_embeddings,
)


def write_source_embeddings(source: str, storage: Storage, samples_version: int,
                            progress: Throttle | None = None) -> SourceEmbeddings:
    """Replace the source's rows of `source_embeddings` unless identical or of another width
    (`run_partition` of SOURCE_EMBEDDINGS)."""
    return run_partition(SOURCE_EMBEDDINGS, storage, source, progress=progress, samples_version=samples_version)
