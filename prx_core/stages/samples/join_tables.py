"""The tables a source joins (`joins` in the catalog), staged once before `samples` ingests it.

A joined table may hold 100M rows and an ingest unit ~1M keys: each unit must find its own keys
without reading the table, and scanning it once per unit would cost the table times the units.
So each joined table is first copied into a Lance table of one shape (`joins.STAGED_SCHEMA`: key,
its place in the table, caption, embedding, metadata) with a BTREE index on the key, which the
units' `Joiner`s query in IN-lists (`prx_core.sources.joins`). Staging is itself work units (one
per joined file or Lance fragment, written by workers as uncommitted fragments), then one commit
per table and one index build, on a worker (its memory grows with the table); the driver holds
one summary per file.

A staged table lives at `<root>/_state/joins/<source>/<digest>.lance`, the digest over the join
spec, the table's listing (file names and sizes, or the Lance version) and this code's version:
a rerun finds it and stages nothing, a changed table or join stages a new one, and the source's
other staged tables are removed. A joined row with a null key can match no sample and is not
staged. A table that cannot be staged (missing, an unreadable file, a named column absent) fails
the run before ingest with `JoinStagingError`: one line naming the source, the table and the fix.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from prx_core.compute.parallel import Throttle, run_on_worker
from prx_core.compute.units import Manifest, Unit, UnitFailed, UnitRun, run_units
from prx_core.sources.catalog import JoinSpec, SourceSpec
from prx_core.sources.joins import STAGED_SCHEMA, staged_schema
from prx_core.sources.tables import lance_options, metadata_values
from prx_core.store import lance_io
from prx_core.store.storage import Storage, filesystem_for

STAGE_VERSION = "1"  # bump when the staged shape or its order changes: every table is staged again
STATE = ("_state", "joins")
INDEX_NAME = "key_btree"
READ_ROWS = 16_384  # rows of a joined file per batch on the staging worker
FRAGMENT_ROWS = 1_000_000


class JoinStagingError(RuntimeError):
    """A joined table that cannot be staged; the message is one line: source, table, fix."""


@dataclass(frozen=True)
class _Plan:
    """One joined table to stage: where it goes, and its files (or Lance fragments) in order."""

    index: int
    join: JoinSpec
    uri: str
    files: list[tuple[str, int]]
    names: list[str]
    version: int | None


def stage_joins(spec: SourceSpec, storage: Storage, progress: Throttle | None = None) -> list[str]:
    """The staged table of each of `spec.joins` (in catalog order), staging those not staged yet
    (progress lines through `progress`'s report); the source's other staged tables are removed."""
    if not spec.joins:
        return []
    plans = [_plan(spec, j, join, storage) for j, join in enumerate(spec.joins)]
    todo = list({p.uri: p for p in plans if not _ready(p.uri, storage)}.values())
    if todo:
        lines = None if progress is None else Throttle(progress.report, f"{progress.label}: staging joined tables",
                                                        progress.seconds, "files")
        _stage(spec, storage, plans, todo, lines)
    _forget_stale(storage, spec.name, {posixpath.basename(p.uri) for p in plans})
    return [p.uri for p in plans]


def _plan(spec: SourceSpec, index: int, join: JoinSpec, storage: Storage) -> _Plan:
    from prx_core.sources.readers import fragment_sizes

    options = storage.storage_options
    try:
        files = fragment_sizes(SourceSpec(name=spec.name, format=join.format, uri=join.uri), options)
        version = None
        if join.format == "lance":
            version = lance_io.require_table(join.uri, lance_options(join.uri, options)).version
    except Exception as exc:  # missing, not a Lance dataset, no permission
        raise JoinStagingError(_line(spec, index, join, f"{type(exc).__name__}: {exc}",
                                     f"fix joins[{index}].uri (a parquet file, a folder of parquet files, or a "
                                     "Lance dataset folder `<name>.lance` with format lance)")) from exc
    if not files and join.format == "parquet":
        raise JoinStagingError(_line(spec, index, join, "no .parquet file there",
                                     f"fix joins[{index}].uri, or give format lance for a Lance dataset"))
    payload = {"code": STAGE_VERSION, "join": asdict(join), "files": files, "version": version}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode("utf-8", "surrogateescape"))
    uri = storage.uri(*STATE, spec.name, f"{digest.hexdigest()[:16]}.lance")
    names = [f"fragment {f}" if join.format == "lance" else _relative(join.uri, f) for f, _ in files]
    return _Plan(index, join, uri, files, names, version)


def _stage(spec: SourceSpec, storage: Storage, plans: list[_Plan], todo: list[_Plan],
           progress: Throttle | None) -> None:
    """Stage `todo` (of the source's `plans`) as work units, then commit and index each table.

    The attempt is named after all the source's tables, so a run that died between two tables'
    commits resumes; its units list no outputs for a discarded attempt to delete, because a table
    committed before the death holds them (a crash can leave unreferenced files, never a broken table)."""
    units = [Unit(f"j{p.index}-{k:06d}", 0, {"source": spec.name, "index": p.index, "join": asdict(p.join),
                                             "uri": p.uri, "file": k, "path": path, "name": p.names[k],
                                             "version": p.version})
             for p in todo for k, (path, _) in enumerate(p.files)]
    manifest = Manifest("joins", spec.name, {"tables": [posixpath.basename(p.uri) for p in plans]}, STAGE_VERSION)
    run = UnitRun.open(storage, manifest)
    try:
        results = run_units(run, units, stage_unit, progress=progress, max_retries=1)
    except UnitFailed as exc:
        cause = getattr(exc.__cause__, "cause", None)
        if isinstance(cause, JoinStagingError):
            raise JoinStagingError(str(cause)) from exc
        raise JoinStagingError(f"source {spec.name!r}: its joined tables could not be staged: {exc}. Fix the "
                               "cause and rerun samples (staged files are kept for the rerun)") from exc
    options = storage.lance_storage_options()
    for plan in todo:
        fragments = lance_io.fragments_from_json(f for s in results.summaries if s["uri"] == plan.uri
                                                 for f in s["fragments"])
        lance_io.replace_rows(plan.uri, "", fragments, staged_schema(plan.join.uri, plan.names), options)
        if not _indexed(lance_io.require_table(plan.uri, options)):
            run_on_worker(_build_index, plan.uri, options)
    run.finish()


def stage_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: one joined file (or Lance fragment) as uncommitted fragments of the staged table."""
    spec = unit.spec
    join = JoinSpec(**{**spec["join"], "metadata_columns": tuple(spec["join"]["metadata_columns"])})
    source = SourceSpec(name=spec["source"], format="parquet", uri=join.uri)  # for the error line only
    counts = {"rows": 0, "null_keys": 0}

    def staged(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            out = staged_batch(join, batch, spec["file"], counts["rows"] + counts["null_keys"])
            counts["null_keys"] += batch.num_rows - out.num_rows
            counts["rows"] += out.num_rows
            yield out

    batches = _read(source, spec["index"], join, spec["path"], spec["name"], spec["version"], run.storage)
    try:
        reader = pa.RecordBatchReader.from_batches(STAGED_SCHEMA, staged(batches))
        written = lance_io.write_fragments(spec["uri"], reader, STAGED_SCHEMA, run.storage.lance_storage_options(),
                                           FRAGMENT_ROWS)
    except Exception as exc:  # a corrupt file, a key or vector that does not convert
        raise JoinStagingError(_line(source, spec["index"], join, f"{spec['name']}: {type(exc).__name__}: {exc}",
                                     "replace or remove that file (or fix the column names in the catalog), "
                                     "then rerun samples")) from exc
    return {"uri": spec["uri"], "rows": counts["rows"], "null_keys": counts["null_keys"],
            "fragments": [f.to_json() for f in written], "outputs": []}  # see _stage


def _read(source: SourceSpec, index: int, join: JoinSpec, path: str, name: str, version: int | None,
          storage: Storage) -> Iterator[pa.RecordBatch]:
    """The joined columns of one file or fragment, batch by batch; a named column the file lacks
    is a `JoinStagingError` here, before anything is read."""
    import pyarrow.parquet as pq

    wanted = list(dict.fromkeys(c for c in (join.key_column, join.caption_column, join.embedding_column,
                                            *join.metadata_columns) if c))
    try:
        if join.format == "lance":
            dataset = lance_io.require_table(join.uri, lance_options(join.uri, storage.storage_options))
            dataset = dataset.checkout_version(version) if version is not None else dataset
            names = dataset.schema.names
        else:
            with filesystem_for(path, storage.storage_options).open(path, "rb") as handle:
                names = pq.ParquetFile(handle).schema_arrow.names
    except Exception as exc:
        raise JoinStagingError(_line(source, index, join, f"{name}: {type(exc).__name__}: {exc}",
                                     "replace or remove that file, then rerun samples")) from exc
    missing = [c for c in wanted if c not in names]
    if missing:
        raise JoinStagingError(_line(source, index, join, f"{name} has no column(s) {missing} (it has {names})",
                                     f"fix joins[{index}]'s column names in the catalog"))
    if join.format == "lance":
        return iter(dataset.get_fragment(int(path)).to_batches(columns=wanted, batch_size=READ_ROWS))
    return _parquet_batches(path, wanted, storage)


def _parquet_batches(path: str, columns: list[str], storage: Storage) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    with filesystem_for(path, storage.storage_options).open(path, "rb") as handle:
        yield from pq.ParquetFile(handle).iter_batches(batch_size=READ_ROWS, columns=columns)


def staged_batch(join: JoinSpec, batch: pa.RecordBatch, file: int, first_row: int) -> pa.RecordBatch:
    """A joined file's batch in the staged shape: keys as text, its (file, row) place, the caption,
    the embedding as float32s, the metadata columns as strings; rows with a null key left out."""
    rows = pa.array(np.arange(first_row, first_row + batch.num_rows, dtype=np.int64))
    keep = batch.column(join.key_column).is_valid()
    batch, rows = batch.filter(keep), rows.filter(keep)  # row numbers count the rows left out too
    n = batch.num_rows
    columns = {"key": batch.column(join.key_column).cast(pa.string()),
               "file": pa.array(np.full(n, file, dtype=np.int32)), "row": rows,
               "caption": batch.column(join.caption_column).cast(pa.string()) if join.caption_column
               else pa.nulls(n, pa.string()),
               "embedding": batch.column(join.embedding_column).cast(pa.list_(pa.float32())) if join.embedding_column
               else pa.nulls(n, pa.list_(pa.float32()))}
    values = [metadata_values(batch.column(name)) for name in join.metadata_columns]
    entries = [[(name, v[i]) for name, v in zip(join.metadata_columns, values) if v[i] is not None] or None
               for i in range(n)]
    columns["metadata"] = pa.array(entries, pa.map_(pa.string(), pa.string()))
    return pa.RecordBatch.from_arrays([columns[f.name] for f in STAGED_SCHEMA], schema=STAGED_SCHEMA)


def _indexed(dataset: Any) -> bool:
    return not dataset.count_rows() or any(d.name == INDEX_NAME for d in dataset.describe_indices())


def _build_index(uri: str, options: dict[str, str] | None) -> None:
    """On a worker: the BTREE index on the staged table's key (none for an empty table)."""
    dataset = lance_io.require_table(uri, options)
    if not _indexed(dataset):
        dataset.create_scalar_index("key", "BTREE", name=INDEX_NAME)


def _ready(uri: str, storage: Storage) -> bool:
    """Whether `uri` is staged (committed; indexed now if a run died before its index was built)."""
    options = storage.lance_storage_options()
    dataset = lance_io.open_table(uri, options)
    if dataset is None:
        return False
    if not _indexed(dataset):
        run_on_worker(_build_index, uri, options)
    return True


def _forget_stale(storage: Storage, source: str, keep: set[str]) -> None:
    """Remove the source's staged tables that none of its joins use any more."""
    fs, folder = storage.filesystem(), storage.uri(*STATE, source)
    fs.invalidate_cache()
    if not fs.exists(folder):
        return
    for path in fs.ls(folder, detail=False):
        if posixpath.basename(path.rstrip("/")) not in keep:
            fs.rm(path, recursive=True)


def _relative(uri: str, path: str) -> str:
    root, full = posixpath.normpath(uri.split("://", 1)[-1]), posixpath.normpath(path.split("://", 1)[-1])
    return posixpath.basename(full) if full == root else posixpath.relpath(full, root)


def _line(spec: SourceSpec, index: int, join: JoinSpec, problem: str, fix: str) -> str:
    return f"source {spec.name!r}: joined table {join.uri} (joins[{index}]) cannot be staged: {problem}; {fix}"[:1500]
