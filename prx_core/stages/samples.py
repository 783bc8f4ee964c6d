"""Stage `samples`: ingest one source into the unified table, refusals into `rejects`.

The source's files (parquet files, tar shards, image folders, Lance fragments) are grouped into
units of about `unit_bytes`; one Ray task per unit reads them, validates every image and writes
the accepted rows straight into uncommitted Lance fragments of up to a million rows (so a fresh
table needs no compaction of its image bytes) and its refusals into `rejects` fragments. The
driver holds one summary per unit and swaps the source's rows in one commit, so a crash at any
point leaves the previous version whole, and a rerun resumes from the recorded units.

A fragment that cannot be read is one `unreadable_fragment` reject (with the rows read before);
a unit that keeps failing (a worker killed out of memory, a hang past `unit_seconds`) becomes
one such reject per fragment of the unit, carrying the error, and the rest of the source goes on.
A source that yields nothing (a folder matching no file) never replaces a partition holding rows
unless the run says `allow_empty` (`EmptySource`).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units
from prx_core.compute.shuffle import KeyCounts, count_keys
from prx_core.compute.units import UNIT_SECONDS, Manifest, Unit, UnitResults, UnitRun, run_units
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS, check_max_chars
from prx_core.sources.catalog import SourceSpec
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.store import lance_io, schemas
from prx_core.store.locks import exclusive
from prx_core.store.partitions import (
    commit_unit_outputs,
    reject_examples,
    reject_row,
    rejects_predicate,
    source_predicate,
    unit_outputs,
    write_rejects,
)
from prx_core.store.storage import Storage

UNREADABLE_FRAGMENT = "unreadable_fragment"
UNIT_BYTES = 64 << 30  # ~1M images of 64 KB: one unit, one Lance fragment, ~an hour of one core
FRAGMENT_ROWS = 1_000_000  # Lance rows per data file: what queries and compaction want


class EmptySource(RuntimeError):
    """The source yielded no sample while its partition holds rows: refused, not emptied."""


@dataclass
class SamplesReport:
    source: str
    rows: int
    bytes: int
    fragments_read: int
    seconds: float
    rejected: int
    samples_version: int
    rejects_version: int
    reasons: dict[str, int] = field(default_factory=dict)
    units: UnitResults | None = None
    captions_cleaned: int = 0  # source captions that held control characters (prx_core.models.caption_text)
    captions_truncated: int = 0  # source captions longer than max_caption_chars, cut

    @property
    def images_per_second(self) -> float:
        return (self.rows + self.rejected) / max(self.seconds, 1e-9)


def group_fragments(sizes: list[tuple[str, int]], unit_bytes: int) -> list[Unit]:
    """Consecutive source fragments grouped into units of about `unit_bytes` (a bigger fragment is
    a unit of its own): the same listing always gives the same units."""
    units: list[Unit] = []
    group: list[str] = []
    size = 0
    for fragment, nbytes in sizes:
        if group and size + nbytes > unit_bytes:
            units.append(Unit(f"u{len(units):06d}", 0, {"fragments": group}))
            group, size = [], 0
        group.append(fragment)
        size += nbytes
    if group:
        units.append(Unit(f"u{len(units):06d}", 0, {"fragments": group}))
    return units


def ingest_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: read a group of source fragments, write its samples and rejects as Lance fragments
    (no commit). A corrupt file becomes one reject row for what could not be read."""
    storage, params = run.storage, run.manifest.params
    spec = SourceSpec.from_dict(params["spec"])
    rejects: list[pa.Table] = []
    counts: Counter[str] = Counter()

    def accepted() -> Iterator[pa.RecordBatch]:
        for fragment in unit.spec["fragments"]:
            read = 0
            pause_point(f"samples:fragment:{fragment.rstrip('/').rsplit('/', 1)[-1]}")  # fault tests: a hang
            try:
                for batch in read_fragment(spec, fragment, storage.storage_options):
                    samples, refused = ingest_batch(spec.name, batch, params["max_pixels"],
                                                    params.get("max_caption_chars", DEFAULT_MAX_CAPTION_CHARS), counts)
                    rejects.append(refused)
                    read += batch.num_rows
                    counts.update(rows=samples.num_rows, bytes=int(pc.sum(samples["num_bytes"]).as_py() or 0))
                    yield from samples.to_batches()
            except Exception as exc:  # keep what was read, record the rest as lost
                rejects.append(unreadable_fragment(spec.name, fragment, read, exc))

    uri = storage.lance_uri("samples")
    reader = pa.RecordBatchReader.from_batches(schemas.SAMPLES, accepted())
    written = lance_io.write_fragments(uri, reader, schemas.SAMPLES, storage.lance_storage_options(), FRAGMENT_ROWS)
    refused = pa.concat_tables(rejects) if rejects else schemas.REJECTS.empty_table()
    refused_fragments = write_rejects(storage, refused)
    return {
        "rows": counts["rows"], "bytes": counts["bytes"], "rejected": refused.num_rows,
        "reasons": dict(Counter(refused["reason"].to_pylist())), "source_fragments": len(unit.spec["fragments"]),
        "captions_cleaned": counts["captions_cleaned"], "captions_truncated": counts["captions_truncated"],
        **unit_outputs(storage, "samples", written, refused_fragments),
    }


def unreadable_fragment(source: str, fragment: str, rows_read: int, exc: Exception | str) -> pa.Table:
    """One reject row standing for the unreadable rest of a source fragment (a corrupt parquet
    file or tar shard, or a unit that kept failing): the run goes on, and the loss is visible
    with its cause."""
    name = fragment if len(fragment) < 200 else f"{fragment[:180]}..."
    cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    message = cause[:300] + f" (after {rows_read} rows)"
    row = reject_row(f"{source}/{name}", source, name, None, "samples", UNREADABLE_FRAGMENT, message)
    return pa.Table.from_pylist([row], schema=schemas.REJECTS)


def failed_unit(unit: Unit, run: UnitRun, message: str) -> dict[str, Any]:
    """On the driver, for a unit that kept failing: its fragments as `unreadable_fragment` rejects
    (nothing of it is kept: what its attempts wrote is never committed)."""
    source = run.manifest.partition
    refused = pa.concat_tables([unreadable_fragment(source, f, 0, message) for f in unit.spec["fragments"]])
    return {"rows": 0, "bytes": 0, "rejected": refused.num_rows, "reasons": {UNREADABLE_FRAGMENT: refused.num_rows},
            "source_fragments": len(unit.spec["fragments"]),
            **unit_outputs(run.storage, "samples", [], write_rejects(run.storage, refused))}


def source_fingerprint(spec: SourceSpec, sizes: list[tuple[str, int]]) -> str:
    """Changes when the source's listing does (names and sizes): part of the run manifest."""
    lines = [spec.format, spec.uri, *(f"{name}\t{size}" for name, size in sizes)]
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()[:16]


@exclusive("samples")
def build_samples(spec: SourceSpec, storage: Storage, max_pixels: int = DEFAULT_MAX_PIXELS,
                  progress: Throttle | None = None, unit_bytes: int = UNIT_BYTES,
                  max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS,
                  unit_seconds: float = UNIT_SECONDS, allow_empty: bool = False) -> SamplesReport:
    """Ingest `spec` and replace its rows in `samples` and its `samples`-stage rows in `rejects`;
    a unit running longer than `unit_seconds` is cancelled and its fragments become rejects. A
    source that yields no sample and no reject raises `EmptySource` before any commit when the
    partition holds rows, unless `allow_empty` (the attempt stays recorded for that rerun)."""
    check_max_chars(max_caption_chars)
    start = time.monotonic()
    sizes = fragment_sizes(spec, storage.storage_options)
    units = group_fragments(sizes, unit_bytes)
    manifest = Manifest("samples", spec.name, {"source": source_fingerprint(spec, sizes)}, "2",
                        {"spec": spec.to_dict(), "max_pixels": max_pixels, "unit_bytes": unit_bytes,
                         "max_caption_chars": max_caption_chars})
    lance_io.upgrade_table(storage.lance_uri("samples"), schemas.SAMPLES, storage.lance_storage_options())
    run = UnitRun.open(storage, manifest)
    results = run_units(run, units, ingest_unit, progress=progress, time_limit_s=unit_seconds, on_failed=failed_unit)
    if not allow_empty and results.total("rows") + results.total("rejected") == 0:
        refuse_emptying(spec, storage, len(sizes))
    pause_point("samples:before_commit")  # fragments written, nothing committed
    samples_version, rejects_version = commit_unit_outputs(storage, "samples", spec.name, "samples", results.summaries)
    run.finish()
    reasons = results.counts("reasons")
    return SamplesReport(
        source=spec.name, rows=results.total("rows"), bytes=results.total("bytes"), fragments_read=len(sizes),
        seconds=time.monotonic() - start, rejected=results.total("rejected"), samples_version=samples_version,
        rejects_version=rejects_version, reasons=reasons, units=results,
        captions_cleaned=results.total("captions_cleaned"), captions_truncated=results.total("captions_truncated"),
    )


def refuse_emptying(spec: SourceSpec, storage: Storage, fragments: int) -> None:
    """Raise `EmptySource` when the partition of an empty source holds rows (samples or rejects)."""
    options = storage.lance_storage_options()
    held = 0
    partition = (("samples", source_predicate(spec.name)), ("rejects", rejects_predicate(spec.name, "samples")))
    for table, predicate in partition:
        dataset = lance_io.open_table(storage.lance_uri(table), options)
        held += dataset.count_rows(filter=predicate) if dataset is not None else 0
    if held:
        raise EmptySource(
            f"source {spec.name!r} ({spec.format} at {spec.uri}) yielded no sample ({fragments} files or folders "
            f"listed), and its partition holds {held} rows: refusing to replace them with nothing. Fix the "
            "source's uri (or restore its files), or, to empty the partition on purpose, rerun `samples` with "
            "run config `allow_empty: true`.")


def count_sample_ids(storage: Storage, source: str, version: int, unit_rows: int = 1_000_000) -> KeyCounts:
    """Rows and distinct `sample_id`s of the partition at `version`, counted on workers."""
    uri, options = storage.lance_uri("samples"), storage.lance_storage_options()
    predicate = source_predicate(source)
    _, units = plan_row_units(uri, predicate, unit_rows, options, version=version)
    return count_keys(uri, version, predicate, "sample_id", units, options)


def rejected_files(storage: Storage, source: str, limit: int = 50) -> list[dict[str, Any]]:
    return reject_examples(storage, source, "samples", limit)
