"""Stage `samples`: ingest one source into the unified table, refusals into `rejects`.

The source's files (parquet files, tar shards, image folders, Lance fragments) are grouped into
units of about `unit_bytes`, cut again where bytes mislead: a URL table into row ranges of at most
`unit_rows` rows, an image folder into ranges of at most `unit_files` files
(`prx_core.stages.samples.units`). One Ray task per unit (`prx_core.stages.samples.ingest`) reads
them, validates every image and writes the accepted rows straight into uncommitted Lance fragments
of up to a million rows (so a fresh table needs no compaction of its image bytes) and its refusals
into `rejects` fragments. The
driver holds one summary per unit and swaps the source's rows in one commit, so a crash at any
point leaves the previous version whole, and a rerun resumes from the recorded units.

A fragment that cannot be read is one `unreadable_fragment` reject (with the rows read before);
a unit that keeps failing (a worker killed out of memory, a hang past `unit_seconds`) becomes
one such reject per fragment of the unit (per row of a default-keyed row range), carrying the
error, and the rest of the source goes on (`prx_core.stages.samples.losses`).
A source that yields no sample fails its run with one line saying why (`SourceRefused`, built by
`prx_core.stages.samples.refusals`), unless the run says `allow_empty`. When every sample was refused,
the rejects are committed first (they are what the operator inspects) and the partition then holds
0 samples; but a partition holding samples is never replaced by nothing: then nothing is
committed (`EmptySource`), as for a source that listed no file or whose files held no row.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

from prx_core.compute import wire
from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units
from prx_core.compute.shuffle import KeyCounts, count_keys
from prx_core.compute.units import UnitResults
from prx_core.models.caption_text import check_max_chars
from prx_core.sources.catalog import DownloadSettings, JoinSpec, SourceSpec
from prx_core.stages.report import ReportSummary, StageReport
from prx_core.stages.samples.ingest import failed_unit, ingest_unit
from prx_core.stages.samples.join_tables import JoinStagingError, stage_joins
from prx_core.stages.samples.refusals import EmptySource, SourceRefused, refuse_nothing
from prx_core.stages.samples.repeated_ids import KeyResolution, settle_sample_ids
from prx_core.stages.samples.settings import SamplesSettings
from prx_core.stages.samples.units import plan_units
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.maintenance import FragmentHealth
from prx_core.store.partitions import commit_unit_outputs, reject_examples, source_predicate
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

__all__ = ["SAMPLES", "EmptySource", "IngestReport", "SamplesReport", "SourceRefused", "build_samples",
           "count_sample_ids", "rejected_files", "settle_ingest"]  # the refusals live in refusals.py


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


def source_fingerprint(spec: SourceSpec, sizes: list[tuple[str, int]]) -> str:
    """Changes when the source's listing does (names and sizes): part of the run manifest."""
    lines = [spec.format, spec.uri, *(f"{name}\t{size}" for name, size in sizes)]
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def pin_source(run: StageRun[SamplesSettings]) -> dict[str, str]:
    """The source's listing (its fingerprint) planned into units, after staging each joined table
    as a key-indexed Lance table (`prx_core.stages.samples.join_tables`) and upgrading the table's schema."""
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


SAMPLES: Stage[SamplesSettings] = Stage(
    "samples", reads=("raw_source",), writes=("samples", "rejects"), after=("raw_source",),
    code_version="2", report_type=IngestReport,
    settings=SamplesSettings,
    unit_sizes=(
        UnitSize("unit_bytes", "Source bytes per ingest unit; one unit writes ~one Lance fragment, so this sets "
                               "fragment size (~1M rows at 64 KB per image)."),
        UnitSize("unit_rows", "URLs per ingest unit of a URL table (url_column; parquet, Lance, Hugging Face parquet): a unit of more "
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
# and before this module and the settlement's moved into the samples package
wire.register_moved_from("prx_core.stages.samples", IngestReport, SamplesReport)
wire.register_moved_from("prx_core.stages.sample_keys", KeyResolution)


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
