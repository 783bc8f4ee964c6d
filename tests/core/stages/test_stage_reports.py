"""Every stage's report answers rows, seconds, Lance versions and units the same way
(prx_core.stages.report), which the asset layer and the benchmark read instead of each report's own
field names; and the names each report declares are its real fields."""

from __future__ import annotations

import dataclasses

import pytest

from prx_core.compute import wire
from prx_core.compute.unit_results import UnitResults
from prx_core.shards.mds.verify import VerifyReport
from prx_core.stages.captions.report import CaptionsReport
from prx_core.stages.entry import STAGES, PublishReport
from prx_core.stages.mds_shards.report import MdsReport
from prx_core.stages.phashes import PhashesReport
from prx_core.stages.report import StageReport
from prx_core.stages.skip_lists.stage import SkipReport

REPORTS = sorted(StageReport.__subclasses__(), key=lambda c: c.__name__)


def _units(ran: int) -> UnitResults:
    return UnitResults(summaries=[{}] * ran, ran=ran, skipped=0, seconds=1.0)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_report_has_a_summary(name: str) -> None:
    assert callable(getattr(STAGES[name].report_type, "summary", None)), name


@pytest.mark.parametrize("report", REPORTS, ids=lambda c: c.__name__)
def test_each_report_declares_real_fields(report: type) -> None:
    fields = {f.name for f in dataclasses.fields(report)}
    properties = {n for n in dir(report) if isinstance(getattr(report, n, None), property)}
    for declared in (report.ROWS, *report.READ.values(), *report.WRITTEN.values()):
        assert declared in fields | properties, (report.__name__, declared)


def test_every_stage_has_its_own_report_class() -> None:
    assert len(REPORTS) >= 11  # every stage's own report (wrappers hold one of them)


def test_a_summary_holds_the_versions_read_and_written() -> None:
    units = _units(3)
    report = PhashesReport("photos", rows=10, failed=1, seconds=2.5, samples_version=3, phashes_version=7, units=units)
    assert report.summary() == type(report.summary())(10, 2.5, {"samples": 3, "phashes": 7}, units)

    captions = CaptionsReport("photos", eligible=40, reused=10, captioned=30, failed=0, seconds=1.0,
                              captions_version=5, read_versions={"samples": 3, "buckets": 4})
    assert captions.summary().rows == 40  # what it was asked to caption, not only what it captioned now
    assert captions.summary().versions == {"samples": 3, "buckets": 4, "captions": 5}  # no text latents: none


def test_a_report_decoded_from_the_wire_summarizes_alike() -> None:
    report = PhashesReport("photos", rows=10, failed=1, seconds=2.5, samples_version=3, phashes_version=7)
    assert wire.decode(wire.encode(report)).summary() == report.summary()


def test_wrappers_and_timeless_reports_summarize() -> None:
    mds = MdsReport("photos", written=8, streams=[], rejects={}, seconds=4.0, read_versions={"samples": 2},
                    mds_index_version=9, units={"chunks": _units(2)})
    published = PublishReport(mds, VerifyReport(), expectations=[], buckets_version=6)
    assert published.summary().versions == {"samples": 2, "mds_index": 9, "buckets": 6}
    assert published.summary().rows == 8 and set(published.summary().units) == {"chunks"}
    skips = SkipReport("photos", streams=[], files=[], read_versions={"mds_index": 9})
    assert (skips.summary().rows, skips.summary().seconds, skips.summary().versions) == (0, None, {"mds_index": 9})
