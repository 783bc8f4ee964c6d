"""What `mds_shards` reports: the streams it wrote (`MdsReport`), then, after its commit, the same
streams read back and counted against `buckets` (`PublishReport`, its `then` step).

Its own module so that the stage's one declaration (prx_core.stages.mds_shards.stage) names the read-back
as its last step: the asset, the Ray job, the tests and the scale benchmark all run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prx_core.compute.unit_results import UnitResults
from prx_core.shards.mds.publish import StreamReport
from prx_core.shards.mds.retention import referenced_chunks
from prx_core.shards.mds.verify import VerifyReport, verify_streams
from prx_core.stages.report import ReportSummary, StageReport, summarize
from prx_core.stages.stage import StageRun
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage, filesystem_for

@dataclass
class MdsReport(StageReport):
    ROWS = "written"
    WRITTEN = {"mds_index": "mds_index_version"}

    source: str
    written: int
    streams: list[StreamReport]
    rejects: dict[str, int]
    seconds: float
    read_versions: dict[str, int] = field(default_factory=dict)
    mds_index_version: int = 0
    units: dict[str, UnitResults] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # stream -> samples, below min_stream_samples: unpublished
    merged: dict[str, int] = field(default_factory=dict)  # stream -> samples, below it: in `_merged/<stream>`

    @property
    def images_per_second(self) -> float:
        return self.written / max(self.seconds, 1e-9)


@dataclass
class StreamCount:
    name: str
    expected: int  # samples the stream must hold
    bucketed: int | None  # rows `buckets` has for it (None: no `buckets` table)


@dataclass
class PublishReport:
    """`mds_shards`: the streams written, read back, and what `buckets` says they should hold."""

    mds: MdsReport
    verified: VerifyReport
    expectations: list[StreamCount]
    buckets_version: int | None

    def summary(self) -> ReportSummary:
        return summarize(self.mds, buckets=self.buckets_version)


def verify_published(report: MdsReport, run: StageRun) -> PublishReport:
    """`then` of `mds_shards`, under its lock after the commit: the streams read back, and their counts
    against `buckets`."""
    verified = verify_streams([s.uri for s in report.streams], run.storage.storage_options)
    expectations, buckets_version = count_expected(run.storage, run.partition, report)
    return PublishReport(report, verified, expectations, buckets_version)


def streams_in_place(run: StageRun, report: PublishReport) -> bool:
    """Every stream the report published still names exactly its chunks (index.json, or member.json
    in `_merged`): a stream rewritten (opt-outs), unpublished or removed since is written again."""
    for stream in report.mds.streams:
        fs = filesystem_for(stream.uri, run.storage.storage_options)
        fs.invalidate_cache()
        if referenced_chunks(fs, stream.uri) != set(stream.chunks):
            return False
    return True


def count_expected(storage: Storage, source: str, report: MdsReport) -> tuple[list[StreamCount], int | None]:
    """Per stream, the rows `buckets` has for it, counted by the table's index per stream, never
    read row by row; and the `buckets` version counted."""
    buckets = lance_io.open_table(storage.lance_uri("buckets"), storage.lance_storage_options())
    out = []
    for stream in report.streams:
        where = (f"{source_predicate(source)} AND tier = {stream.tier} "
                 f"AND bucket = {lance_io.sql_literal(f'{stream.width}x{stream.height}')}")
        out.append(StreamCount(stream.name, stream.samples, None if buckets is None else buckets.count_rows(filter=where)))
    return out, None if buckets is None else buckets.version
