"""The stages by name, and `run_stage`: what an asset runs, in its own process or as a Ray job.

`STAGES` holds every stage's declaration (`prx_core.stages.stage.Stage`); `run_stage(name, kwargs,
log)` runs one through `run_partition`, the call both paths make. In the Dagster process the
asset calls it directly; on a cluster with a job server, `python -m prx_core.stages.job` calls
it inside a Ray job (long runs outlive Ray Client connections) and sends the report back through
Dagster Pipes. Arguments and reports are `prx_core` dataclasses and plain values, so they cross
as JSON (`prx_core.compute.wire`); a `Progress` argument becomes progress lines in `log`.
Three stages report more than their own run (`then`): the ingest settles repeated sample ids,
`mds_shards` reads its streams back, `duplicates` checks its keepers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.shards.verify import VerifyReport, verify_streams
from prx_core.stages.buckets import BUCKETS
from prx_core.stages.caption_embeddings import CAPTION_EMBEDDINGS
from prx_core.stages.captions import CAPTIONS
from prx_core.stages.duplicates import DUPLICATES, DuplicatesReport
from prx_core.stages.duplicates_check import KeeperCheck, check_keepers
from prx_core.stages.explorer import EXPLORER
from prx_core.stages.labels import CAPTION_LABELS
from prx_core.stages.mds_shards import MDS_SHARDS, MdsReport
from prx_core.stages.phashes import PHASHES
from prx_core.stages.report import ReportSummary, summarize
from prx_core.stages.sample_keys import KeyResolution, settle_sample_ids
from prx_core.stages.samples import SAMPLES, SamplesReport, rejected_files
from prx_core.stages.skip_lists import SKIP_LISTS
from prx_core.stages.stage import Stage, StageRun, required, run_partition
from prx_core.stages.text_latents import TEXT_LATENTS
from prx_core.store import lance_io, maintenance
from prx_core.store.maintenance import FragmentHealth
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage


@dataclass(frozen=True)
class Progress:
    """Progress lines `label: done/total unit, rate, ETA` in the caller's log (a `Throttle`)."""

    label: str
    unit: str = "units"


@dataclass
class IngestReport:
    """`samples`: the ingest, its sample-id settlement, fragment health and a few refused files."""

    samples: SamplesReport
    keys: KeyResolution
    health: FragmentHealth
    rejected_files: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> ReportSummary:
        return self.samples.summary()


def settle_ingest(report: SamplesReport, run: StageRun) -> IngestReport:
    """After the ingest's lock: repeated sample ids settled (under their own lock), then fragment
    health and a few refused files, as the partition now reads."""
    storage = run.storage
    keys = settle_sample_ids(storage, report, run["max_duplicate_rate"])
    health = maintenance.fragment_health(storage.lance_uri("samples"), storage_options=storage.lance_storage_options())
    return IngestReport(report, keys, health, rejected_files(storage, run.partition))


INGEST = dataclasses.replace(  # `samples` as the asset runs it: the ingest, then its settlement
    SAMPLES, report_type=IngestReport, then=settle_ingest,
    settings={**SAMPLES.settings, "max_duplicate_rate": required(float)},
    unpinned=(*SAMPLES.unpinned, "max_duplicate_rate"), reusable=lambda report: report.samples.rows > 0)


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
    """`then` of `mds_shards`, after its lock is released: the streams read back, and their counts
    against `buckets`."""
    verified = verify_streams([s.uri for s in report.streams], run.storage.storage_options)
    expectations, buckets_version = count_expected(run.storage, run.partition, report)
    return PublishReport(report, verified, expectations, buckets_version)


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


PUBLISH = dataclasses.replace(  # `mds_shards` as the asset runs it: the streams, then read back
    MDS_SHARDS, report_type=PublishReport, then=verify_published)


@dataclass
class GroupsReport:
    """`duplicates`: the run, its keeper check, and a few rows of the groups for the UI."""

    duplicates: DuplicatesReport
    check: KeeperCheck
    sample: list[dict[str, Any]]

    def summary(self) -> ReportSummary:
        return self.duplicates.summary()


def check_groups(report: DuplicatesReport, run: StageRun) -> GroupsReport:
    """`then` of `duplicates`, after its lock is released: the keeper check of the version it
    committed (of the groups it changed, when it could: duplicates_check), on workers, and
    `sample_rows` rows of it for the UI."""
    storage = run.storage
    check = check_keepers(storage, report, run["unit_rows"], run["rows_per_bucket"])
    table = lance_io.open_table(storage.lance_uri("duplicates"), storage.lance_storage_options())
    sample = [] if table is None else table.checkout_version(report.duplicates_version).to_table(
        columns=["group_id", "sample_id", "source", "keeper", "pixels"], limit=run["sample_rows"]).to_pylist()
    return GroupsReport(report, check, sample)


GROUPS = dataclasses.replace(  # `duplicates` as the asset runs it: the groups, then their keeper check
    DUPLICATES, report_type=GroupsReport, then=check_groups, settings={**DUPLICATES.settings, "sample_rows": 30},
    unpinned=(*DUPLICATES.unpinned, "sample_rows"))


STAGES: dict[str, Stage] = {stage.name: stage for stage in (INGEST, BUCKETS, PHASHES, PUBLISH, SKIP_LISTS, GROUPS,
                                                             CAPTIONS, CAPTION_LABELS, CAPTION_EMBEDDINGS,
                                                             TEXT_LATENTS, EXPLORER)}
# the classes the wrapped stages add on the wire, nested ones included (each stage module registers its own)
WIRE_TYPES = wire.register_all(Progress, IngestReport, KeyResolution, FragmentHealth, PublishReport, StreamCount,
                               VerifyReport, GroupsReport, KeeperCheck)


def report_type(name: str) -> type:
    """The class stage `name` reports (its declaration's `report_type`): the only report accepted."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name].report_type


def run_stage(name: str, kwargs: dict[str, Any], log: Callable[[str], None]) -> Any:
    """Run stage `name` with `kwargs` (storage, source, settings); every `Progress` among them
    reports through `log`."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    bound = {k: Throttle(log, v.label, unit=v.unit) if isinstance(v, Progress) else v for k, v in kwargs.items()}
    return run_partition(STAGES[name], **bound)
