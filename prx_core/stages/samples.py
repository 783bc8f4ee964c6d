"""Stage `samples`: ingest one source into the unified table, refusals into `rejects`.

One Ray task per source fragment reads it, validates every image and writes the accepted
rows straight into uncommitted Lance fragments; the driver then swaps the source's rows in
one commit, so a crash at any point leaves the previous version whole.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Progress, map_tasks
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.sources.catalog import SourceSpec
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.readers import list_fragments, read_fragment
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.partitions import reject_row, rejects_predicate, source_predicate, write_partition
from prx_core.store.storage import Storage

UNREADABLE_FRAGMENT = "unreadable_fragment"
TASK_SCHEMA = pa.schema(
    [("fragment", pa.string()), ("lance_fragments", pa.string()), ("rejects", pa.binary()),
     ("rows", pa.int64()), ("bytes", pa.int64()), ("seconds", pa.float64())]
)


@dataclass
class SamplesReport:
    source: str
    rows: int
    bytes: int
    fragments_read: int
    seconds: float
    rejects: pa.Table
    samples_version: int
    rejects_version: int
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def images_per_second(self) -> float:
        return (self.rows + self.rejects.num_rows) / max(self.seconds, 1e-9)


def ingest_fragment(task: dict[str, Any]) -> pa.Table:
    """Ray task: read one source fragment, write its samples as Lance fragments (no commit)."""
    start = time.monotonic()
    spec = SourceSpec(**json.loads(task["spec"]))
    options = json.loads(task["storage_options"])
    rejects: list[pa.Table] = []
    counts = {"rows": 0, "bytes": 0}

    def accepted() -> Any:
        try:
            for batch in read_fragment(spec, task["fragment"], options):
                samples, refused = ingest_batch(spec.name, batch, task["max_pixels"])
                rejects.append(refused)
                counts["rows"] += samples.num_rows
                counts["bytes"] += int(pc.sum(samples["num_bytes"]).as_py() or 0)
                yield from samples.to_batches()
        except Exception as exc:  # a corrupt file: keep what was read, record the rest as lost
            rejects.append(unreadable_fragment(spec.name, task["fragment"], counts["rows"], exc))

    reader = pa.RecordBatchReader.from_batches(schemas.SAMPLES, accepted())
    fragments = lance_io.write_fragments(task["samples_uri"], reader, schemas.SAMPLES, task["lance_options"])
    refused = pa.concat_tables(rejects) if rejects else schemas.REJECTS.empty_table()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schemas.REJECTS) as writer:
        writer.write_table(refused)
    row = {
        "fragment": task["fragment"],
        "lance_fragments": json.dumps([f.to_json() for f in fragments]),
        "rejects": sink.getvalue().to_pybytes(),
        "rows": counts["rows"],
        "bytes": counts["bytes"],
        "seconds": time.monotonic() - start,
    }
    return pa.Table.from_pylist([row], schema=TASK_SCHEMA)


def unreadable_fragment(source: str, fragment: str, rows_read: int, exc: Exception) -> pa.Table:
    """One reject row standing for the unreadable rest of a source fragment (a corrupt parquet
    file or tar shard): the run goes on, and the loss is visible with its cause."""
    name = fragment if len(fragment) < 200 else f"{fragment[:180]}..."  # image-folder ids are path lists
    message = f"{type(exc).__name__}: {exc}"[:300] + f" (after {rows_read} rows)"
    row = reject_row(f"{source}/{name}", source, name, None, "samples", UNREADABLE_FRAGMENT, message)
    return pa.Table.from_pylist([row], schema=schemas.REJECTS)


def build_samples(
    spec: SourceSpec, storage: Storage, max_pixels: int = DEFAULT_MAX_PIXELS, progress: Progress | None = None
) -> SamplesReport:
    """Ingest `spec` and replace its rows in `samples` and its `samples`-stage rows in `rejects`."""
    from lance import FragmentMetadata

    start = time.monotonic()
    samples_uri, lance_options = storage.lance_uri("samples"), storage.lance_storage_options()
    fragments = list_fragments(spec, storage.storage_options)
    base = {
        "spec": json.dumps(spec.to_dict()), "storage_options": json.dumps(storage.storage_options),
        "samples_uri": samples_uri, "lance_options": lance_options, "max_pixels": max_pixels,
    }
    tasks = [{**base, "fragment": fragment} for fragment in fragments]
    written: list[Any] = []
    rejects: list[pa.Table] = []
    rows = size = 0
    for result in map_tasks(tasks, ingest_fragment, progress=progress):
        for row in result.to_pylist():
            written += [FragmentMetadata.from_json(json.dumps(f)) for f in json.loads(row["lance_fragments"])]
            rejects.append(pa.ipc.open_stream(row["rejects"]).read_all())
            rows, size = rows + row["rows"], size + row["bytes"]
    refused = pa.concat_tables(rejects) if rejects else schemas.REJECTS.empty_table()
    refused = refused.sort_by("sample_id")
    pause_point("samples:before_commit")  # fragments written, nothing committed
    lance_io.replace_rows(samples_uri, source_predicate(spec.name), written, schemas.SAMPLES, lance_options)
    samples_version = maintenance.refresh_table_indexes(samples_uri, "samples", lance_options).version
    rejects_version = write_partition(storage, "rejects", rejects_predicate(spec.name, "samples"), refused)
    return SamplesReport(
        source=spec.name, rows=rows, bytes=size, fragments_read=len(fragments), seconds=time.monotonic() - start,
        rejects=refused, samples_version=samples_version, rejects_version=rejects_version,
        reasons=dict(Counter(refused.column("reason").to_pylist())),
    )
