"""Stage `samples`: ingest one source into the unified table, refusals into `rejects`.

The source's files (parquet files, tar shards, image folders, Lance fragments) are grouped into
units of about `unit_bytes`, cut again where bytes mislead: a URL table into row ranges of at most
`unit_rows` rows, an image folder into ranges of at most `unit_files` files
(`prx_core.stages.samples_units`). One Ray task per unit reads them, validates every image and writes
the accepted rows straight into uncommitted Lance fragments of up to a million rows (so a fresh
table needs no compaction of its image bytes) and its refusals into `rejects` fragments. The
driver holds one summary per unit and swaps the source's rows in one commit, so a crash at any
point leaves the previous version whole, and a rerun resumes from the recorded units.

A fragment that cannot be read is one `unreadable_fragment` reject (with the rows read before);
a unit that keeps failing (a worker killed out of memory, a hang past `unit_seconds`) becomes
one such reject per fragment of the unit (per row of a default-keyed row range), carrying the
error, and the rest of the source goes on (`prx_core.stages.samples_losses`).
A source that yields no sample fails its run with one line saying why (`SourceRefused`, built by
`prx_core.stages.source_causes`), unless the run says `allow_empty`. When every sample was refused,
the rejects are committed first (they are what the operator inspects) and the partition then holds
0 samples; but a partition holding samples is never replaced by nothing: then nothing is
committed (`EmptySource`), as for a source that listed no file or whose files held no row.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute import wire
from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units
from prx_core.compute.shuffle import KeyCounts, count_keys
from prx_core.compute.units import UNIT_BEGAN, UNIT_SECONDS, Unit, UnitResults, UnitRun
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS, check_max_chars
from prx_core.sources.catalog import DownloadSettings, JoinSpec, SourceSpec
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.joins import Joiner
from prx_core.sources.readers import read_fragment
from prx_core.sources.row_ranges import range_label
from prx_core.sources.tables import ReadGuard
from prx_core.stages.join_tables import JoinStagingError, stage_joins
from prx_core.stages.report import ReportSummary, StageReport
from prx_core.stages.samples_losses import UNREADABLE_FRAGMENT, lost_unit, unreadable_fragment
from prx_core.stages.sample_keys import KeyResolution, settle_sample_ids
from prx_core.stages.samples_units import UNIT_BYTES, UNIT_FILES, UNIT_ROWS, plan_units
from prx_core.stages.source_causes import EmptySource, SourceRefused, examples_by_reason, refuse_nothing
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.stages.takedowns import taken_down_keys
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.maintenance import FragmentHealth
from prx_core.store.partitions import (
    commit_unit_outputs,
    reject_examples,
    source_predicate,
    unit_outputs,
    write_rejects,
)
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

__all__ = ["SAMPLES", "EmptySource", "IngestReport", "SamplesReport", "SourceRefused", "build_samples",
           "count_sample_ids", "rejected_files", "settle_ingest"]  # the refusals live in source_causes

FRAGMENT_ROWS = 1_000_000  # Lance rows per data file: what queries and compaction want
FETCH_SHARE = 0.8  # of a unit's time limit spent fetching URLs at most; the rest decodes, writes and records
MAX_DUPLICATE_RATE = 0.001  # repeated sample_ids moved to rejects at most (the asset passes its check's threshold)


@dataclass
class SamplesReport(StageReport):
    WRITTEN = {"samples": "samples_version", "rejects": "rejects_version"}

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


def ingest_unit(unit: Unit, run: UnitRun, unit_seconds: float | None = None) -> dict[str, Any]:
    """Ray task: read a group of source fragments, write its samples and rejects as Lance fragments
    (no commit). A corrupt file becomes one reject row for what could not be read. URLs stop being
    fetched `FETCH_SHARE` into the unit's time limit (`not_fetched` rejects), so a unit of slow
    hosts commits what it fetched instead of being cancelled whole; taken-down keys are refused
    (`taken_down`), a URL's before it is fetched."""
    storage, params = run.storage, run.manifest.params
    settings = SamplesSettings.from_params(params)
    spec = settings.spec
    began = UNIT_BEGAN.get() or time.time()
    guard = ReadGuard(None if unit_seconds is None else began + unit_seconds * FETCH_SHARE,
                      taken_down_keys(storage, spec.name))
    # the staged joins are not a setting: `pin_source` pins them
    joiner = Joiner(spec, params.get("joins", ()), storage.lance_storage_options())  # every reader's records
    rejects: list[pa.Table] = []
    counts: Counter[str] = Counter()

    part = tuple(unit.spec["part"]) if unit.spec.get("part") else None  # a range of its one fragment

    def accepted() -> Iterator[pa.RecordBatch]:
        pause_point(f"samples:unit:{unit.id}")  # fault tests: a hang
        for fragment in unit.spec["fragments"]:
            read = 0
            pause_point(f"samples:fragment:{fragment.rstrip('/').rsplit('/', 1)[-1]}")  # fault tests: a hang
            try:
                for batch in read_fragment(spec, fragment, storage.storage_options, guard, part):
                    samples, refused = ingest_batch(spec.name, joiner.join(batch), settings.max_pixels,
                                                    settings.max_caption_chars, counts, guard.taken_down)
                    rejects.append(refused)
                    read += batch.num_rows
                    counts.update(rows=samples.num_rows, bytes=int(pc.sum(samples["num_bytes"]).as_py() or 0))
                    yield from samples.to_batches()
            except Exception as exc:  # keep what was read, record the rest as lost
                rejects.append(unreadable_fragment(spec.name, range_label(fragment, part), read, exc))

    uri = storage.lance_uri("samples")
    reader = pa.RecordBatchReader.from_batches(schemas.SAMPLES, accepted())
    written = lance_io.write_fragments(uri, reader, schemas.SAMPLES, storage.lance_storage_options(), FRAGMENT_ROWS)
    refused = pa.concat_tables(rejects) if rejects else schemas.REJECTS.empty_table()
    refused_fragments = write_rejects(storage, refused)
    return {
        "rows": counts["rows"], "bytes": counts["bytes"], "rejected": refused.num_rows,
        "reasons": dict(Counter(refused["reason"].to_pylist())), "source_fragments": len(unit.spec["fragments"]),
        "captions_cleaned": counts["captions_cleaned"], "captions_truncated": counts["captions_truncated"],
        "examples": examples_by_reason(refused),
        **unit_outputs(storage, "samples", written, refused_fragments),
    }


def failed_unit(unit: Unit, run: UnitRun, message: str) -> dict[str, Any]:
    """On the driver, for a unit that kept failing: its fragments as `unreadable_fragment` rejects
    (nothing of it is kept: what its attempts wrote is never committed); a unit's row range of a
    table with default keys as one such reject per row, so every row of the source is accounted for."""
    refused = lost_unit(SamplesSettings.from_params(run.manifest.params).spec, unit.spec, message)
    return {"rows": 0, "bytes": 0, "rejected": refused.num_rows, "reasons": {UNREADABLE_FRAGMENT: refused.num_rows},
            "source_fragments": len(unit.spec["fragments"]), "examples": examples_by_reason(refused),
            **unit_outputs(run.storage, "samples", [], write_rejects(run.storage, refused))}


def source_fingerprint(spec: SourceSpec, sizes: list[tuple[str, int]]) -> str:
    """Changes when the source's listing does (names and sizes): part of the run manifest."""
    lines = [spec.format, spec.uri, *(f"{name}\t{size}" for name, size in sizes)]
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def pin_source(run: StageRun[SamplesSettings]) -> dict[str, str]:
    """The source's listing (its fingerprint) planned into units, after staging each joined table
    as a key-indexed Lance table (`prx_core.stages.join_tables`) and upgrading the table's schema."""
    settings = run.settings
    spec = settings.spec
    check_max_chars(settings.max_caption_chars)
    try:
        joins = stage_joins(spec, run.storage, run.progress)
    except JoinStagingError as exc:  # one line: the source, the table, the fix
        raise SourceRefused(str(exc)) from exc
    plan = plan_units(spec, run.storage.storage_options, settings.unit_bytes, settings.unit_rows, settings.unit_files)
    sizes = plan.sizes
    run.state["units"], run.state["listed"] = plan.units, len(sizes)
    run.params.update(plan.pinned)  # unit_rows, unit_files: in the manifest only where they cut a unit
    run.params["spec"] = spec.to_dict()  # what the workers read (the manifest is JSON)
    if joins:
        run.params["joins"] = joins
    lance_io.upgrade_table(run.storage.lance_uri("samples"), schemas.SAMPLES, run.storage.lance_storage_options())
    return {"source": source_fingerprint(spec, sizes)}


def ingest_units(run: StageRun[SamplesSettings]) -> None:
    run.units("units", run.state["units"], functools.partial(ingest_unit, unit_seconds=run.settings.unit_seconds),
              time_limit_s=run.settings.unit_seconds, on_failed=failed_unit)


def commit_samples(run: StageRun[SamplesSettings]) -> dict[str, int]:
    """The source's rows and rejects swapped in one commit each; a run that kept no sample is
    refused before it (`refuse_nothing`), or its refusal kept for `report_samples` to raise."""
    results = run.results["units"]
    if not (run.settings.allow_empty or results.total("rows")):
        run.state["refusal"] = refuse_nothing(run.settings.spec, run.storage, run.state["listed"], results)
    pause_point("samples:before_commit")  # fragments written, nothing committed
    samples_version, rejects_version = commit_unit_outputs(run.storage, "samples", run.partition, "samples",
                                                           results.summaries, index=index_table)
    return {"samples": samples_version, "rejects": rejects_version}


def report_samples(run: StageRun[SamplesSettings]) -> SamplesReport:
    if run.state.get("refusal") is not None:  # every sample refused: its rejects are committed for inspection
        raise SourceRefused(run.state["refusal"])
    results = run.results["units"]
    return SamplesReport(
        source=run.partition, rows=results.total("rows"), bytes=results.total("bytes"),
        fragments_read=run.state["listed"], seconds=run.seconds, rejected=results.total("rejected"),
        samples_version=run.versions["samples"], rejects_version=run.versions["rejects"],
        reasons=results.counts("reasons"), units=results, captions_cleaned=results.total("captions_cleaned"),
        captions_truncated=results.total("captions_truncated"),
    )


@dataclass
class IngestReport:
    """`samples`: the ingest, its sample-id settlement, fragment health and a few refused files."""

    samples: SamplesReport
    keys: KeyResolution
    health: FragmentHealth
    rejected_files: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> ReportSummary:
        return self.samples.summary()


def settle_ingest(report: SamplesReport, run: StageRun[SamplesSettings]) -> IngestReport:
    """`then`, under the ingest's lock after its commit: repeated sample ids settled, then
    fragment health and a few refused files, as the partition now reads."""
    storage = run.storage
    keys = settle_sample_ids(storage, report, run.settings.max_duplicate_rate)
    health = maintenance.fragment_health(storage.lance_uri("samples"), storage_options=storage.lance_storage_options())
    return IngestReport(report, keys, health, rejected_files(storage, run.partition))


@dataclass(frozen=True, kw_only=True)
class SamplesSettings(Settings):
    """The ingest's settings: the source, the decode and caption caps, the unit sizes, and two checks
    after the commit (an empty source refused unless `allow_empty`; `max_duplicate_rate`)."""

    spec: SourceSpec
    max_pixels: int = DEFAULT_MAX_PIXELS
    unit_bytes: int = UNIT_BYTES
    unit_rows: int = UNIT_ROWS
    unit_files: int = UNIT_FILES
    max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS
    unit_seconds: float = UNIT_SECONDS
    allow_empty: bool = False
    max_duplicate_rate: float = MAX_DUPLICATE_RATE

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SamplesSettings:
        """`pin_source` pins the spec as its dict (what the workers read): rebuilt here."""
        return super().from_params({**params, "spec": SourceSpec.from_dict(params["spec"])})


SAMPLES: Stage[SamplesSettings] = Stage(
    "samples", reads=("raw_source",), writes=("samples", "rejects"), after=("raw_source",),
    code_version="2", report_type=IngestReport,
    settings=SamplesSettings,
    unit_sizes=(
        UnitSize("unit_bytes", "Source bytes per ingest unit; one unit writes ~one Lance fragment, so this sets "
                               "fragment size (~1M rows at 64 KB per image)."),
        UnitSize("unit_rows", "URLs per ingest unit of a URL table (url_column; parquet or Lance): a unit of more "
                              "is cut into row ranges (at row groups where they fall inside), so fetching one "
                              "unit (~1 h at 30 images/s) stays far under unit_seconds."),
        UnitSize("unit_files", "Image files per ingest unit of an image folder: a unit of more is cut into "
                               "ranges of file names (a big folder into several units)."),
        UnitSize("unit_seconds", "Time limit of one ingest unit, retries included: a unit still running (a hang, "
                                 "a worker killed out of memory again and again) is cancelled and its source files "
                                 "become unreadable_fragment rejects."),
    ),
    # unit_rows, unit_files: pinned where they cut; max_duplicate_rate decides after the commit (`then`)
    unpinned=("unit_seconds", "allow_empty", "unit_rows", "unit_files", "max_duplicate_rate"),
    pin=pin_source, work=ingest_units, commit=commit_samples, report=report_samples, then=settle_ingest,
    # the listing and settings as last committed: nothing to re-ingest
    reusable=lambda report: report.samples.rows > 0,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(IngestReport, SamplesReport, KeyResolution, FragmentHealth, SourceSpec, JoinSpec,
                               DownloadSettings)
wire.register_moved("prx_core.stages.entry:IngestReport", IngestReport)  # reports recorded before it moved here


def build_samples(spec: SourceSpec, storage: Storage, progress: Throttle | None = None,
                  **settings: Any) -> SamplesReport:
    """Ingest `spec` (`run_partition` of SAMPLES, its settlement included): its rows in `samples` and
    its `samples`-stage rows in `rejects` replaced; settings max_pixels, unit_bytes, unit_rows,
    unit_files, max_caption_chars, unit_seconds (a unit running longer is cancelled, its fragments
    become rejects), allow_empty and max_duplicate_rate. Returns the ingest's part of the report, its
    counts as settled (the whole `IngestReport`: `run_partition(SAMPLES, ...)`).

    Unless `allow_empty`, a source that yields no sample raises `SourceRefused` (one line: why and
    the fix). Every sample refused: the rejects are committed, then it raises (the partition holds
    0 samples and its rejects), except that a partition holding samples is left whole (`EmptySource`,
    nothing committed). No file listed, or no row at all: nothing is committed; `EmptySource` when
    the partition holds rows. A run refused before its commit stays recorded for a rerun."""
    return run_partition(SAMPLES, storage, progress=progress, spec=spec, **settings).samples


def count_sample_ids(storage: Storage, source: str, version: int, unit_rows: int = 1_000_000) -> KeyCounts:
    """Rows and distinct `sample_id`s of the partition at `version`, counted on workers."""
    uri, options = storage.lance_uri("samples"), storage.lance_storage_options()
    predicate = source_predicate(source)
    _, units = plan_row_units(uri, predicate, unit_rows, options, version=version)
    return count_keys(uri, version, predicate, "sample_id", units, options)


def rejected_files(storage: Storage, source: str, limit: int = 50) -> list[dict[str, Any]]:
    return reject_examples(storage, source, "samples", limit)
