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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prx_core.compute.parallel import Throttle
from prx_core.shards.verify import VerifyReport, verify_streams
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.buckets import BUCKETS
from prx_core.stages.caption_embeddings import build_caption_embeddings
from prx_core.stages.captions import build_captions
from prx_core.stages.duplicates import DuplicatesReport, build_duplicates
from prx_core.stages.duplicates_check import KeeperCheck, check_one_keeper
from prx_core.stages.labels import build_labels
from prx_core.stages.mds_shards import MdsReport, build_mds
from prx_core.stages.phashes import PHASHES
from prx_core.stages.sample_keys import KeyResolution, settle_sample_ids
from prx_core.stages.samples import SamplesReport, build_samples, rejected_files
from prx_core.stages.skip_lists import build_skip_lists
from prx_core.stages.stage import Stage, run_partition
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


def ingest_source(spec: SourceSpec, storage: Storage, *, max_duplicate_rate: float, **build: Any) -> IngestReport:
    report = build_samples(spec, storage, **build)
    keys = settle_sample_ids(storage, report, max_duplicate_rate)
    health = maintenance.fragment_health(storage.lance_uri("samples"), storage_options=storage.lance_storage_options())
    return IngestReport(report, keys, health, rejected_files(storage, spec.name))


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


def publish_mds(source: str, storage: Storage, captioner_version: str, **build: Any) -> PublishReport:
    report = build_mds(source, storage, captioner_version, **build)
    verified = verify_streams([s.uri for s in report.streams], storage.storage_options)
    expectations, buckets_version = count_expected(storage, source, report)
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


@dataclass
class GroupsReport:
    """`duplicates`: the run, its keeper check, and a few rows of the groups for the UI."""

    duplicates: DuplicatesReport
    check: KeeperCheck
    sample: list[dict[str, Any]]


def group_duplicates(storage: Storage, sample_rows: int = 30, **build: Any) -> GroupsReport:
    report = build_duplicates(storage, **build)
    check = check_one_keeper(storage, report.duplicates_version)
    table = lance_io.open_table(storage.lance_uri("duplicates"), storage.lance_storage_options())
    sample = [] if table is None else table.checkout_version(report.duplicates_version).to_table(
        columns=["group_id", "sample_id", "source", "keeper", "pixels"], limit=sample_rows).to_pylist()
    return GroupsReport(report, check, sample)


STAGES: dict[str, Stage] = {stage.name: stage for stage in (BUCKETS, PHASHES)}
LEGACY: dict[str, Callable[..., Any]] = {  # drivers not yet declared as a Stage
    "samples": ingest_source,
    "duplicates": group_duplicates,
    "captions": build_captions,
    "caption_labels": build_labels,
    "caption_embeddings": build_caption_embeddings,
    "mds_shards": publish_mds,
    "skip_lists": build_skip_lists,
}


def run_stage(name: str, kwargs: dict[str, Any], log: Callable[[str], None]) -> Any:
    """Run stage `name` with `kwargs` (storage, source, settings); every `Progress` among them
    reports through `log`."""
    if name not in STAGES and name not in LEGACY:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join([*STAGES, *LEGACY])}")
    bound = {k: Throttle(log, v.label, unit=v.unit) if isinstance(v, Progress) else v for k, v in kwargs.items()}
    if name in LEGACY:
        return LEGACY[name](**bound)
    return run_partition(STAGES[name], **bound)
