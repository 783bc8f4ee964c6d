"""The runner every stage goes through (prx_core.stages.stage) on a real local Ray and real Lance
tables: settings checked by name, phases declared, and a report that stays small whatever the
number of units (the per-unit detail goes under the root, referenced by URI)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from test_row_stages import make_samples

from prx_core.compute import unit_results, wire
from prx_core.compute.unit_results import UnitResults, read_detail
from prx_core.stages import entry
from prx_core.stages.buckets import BUCKETS, BucketsSettings, build_buckets
from prx_core.stages.settings import Settings
from prx_core.stages.stage import run_partition
from prx_core.stages.unchanged import force_next_run, last_commit
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
RAY_LOG_LINE_LIMIT = 4 << 20  # what Ray's job-log tail carries in one message (aiohttp websocket)


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "photos", 20, 3)
    return storage


@dataclass(frozen=True, kw_only=True)
class Tierless(Settings):
    """The buckets settings with a mandatory max_tier."""

    max_tier: int
    unit_rows: int = BucketsSettings().unit_rows


def test_an_unknown_or_missing_setting_is_named(storage: Storage) -> None:
    with pytest.raises(TypeError, match="unknown setting.*unit_row\\b.*settings: max_tier, unit_rows"):
        build_buckets("photos", storage, unit_row=5)
    with pytest.raises(TypeError, match="missing setting.*max_tier"):
        run_partition(replace(BUCKETS, settings=Tierless), storage, "photos")
    with pytest.raises(ValueError, match="invalid source name '../x'"):
        build_buckets("../x", storage)


def test_a_phase_must_be_declared(storage: Storage) -> None:
    def work(run):  # a stage running units of a phase it did not declare
        run.units("chunks", run.state["units"], lambda unit, attempt: {})

    with pytest.raises(ValueError, match="buckets: phase 'chunks' is not declared \\(units\\)"):
        run_partition(replace(BUCKETS, work=work), storage, "photos")


def test_the_report_carries_totals_and_the_detail_holds_every_unit(storage: Storage) -> None:
    report = build_buckets("photos", storage, unit_rows=1)  # a unit per row: 21 units
    units = report.units
    assert units.summaries == [] and units.units == 21 and units.ran == 21
    detail = read_detail(storage, units.detail_uri)
    assert sorted(s["unit"] for s in detail) == sorted({s["unit"] for s in detail}) and len(detail) == 21
    assert units.total("rows") == sum(s["rows"] for s in detail) == 21
    assert units.counts("dropped") == {"aspect_ratio": 3, "below_floor": 3}  # 1200x500 and 300x300: 3 of 20 each
    assert sum(units.counts("histogram").values()) == report.bucketed == 15
    assert units.detail_uri.startswith(storage.uri("_reports", "buckets", "photos"))


def test_a_report_of_25000_units_stays_small_on_the_wire(storage: Storage) -> None:
    """A 100M-row source is ~25,000 units. Their summaries (fragment metadata, file names) in one
    report made a Pipes message Ray's job log refuses; condensed, it is a few KB."""
    report = build_buckets("photos", storage, unit_rows=1)
    detail = read_detail(storage, report.units.detail_uri)
    many = [{**detail[i % len(detail)], "unit": f"u{i:06d}"} for i in range(25_000)]
    whole = UnitResults(many, ran=25_000, skipped=0, seconds=1.0)
    assert len(json.dumps(wire.encode(replace(report, units=whole)))) > 2 * RAY_LOG_LINE_LIMIT  # what main sent
    condensed = replace(report, units=whole.condensed("s3://bucket/detail.jsonl.gz"))
    line = json.dumps(wire.sign_report("key", "buckets", condensed))
    assert len(line) < 16 << 10
    back = wire.open_report([json.loads(line)], "key", "buckets", entry.report_type("buckets"))
    assert back.units.total("rows") == sum(s["rows"] for s in many) and back.units.units == 25_000
    assert back.units.counts("dropped")["below_floor"] == sum(s["dropped"].get("below_floor", 0) for s in many)


def test_only_the_latest_details_are_kept(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unit_results, "KEEP_REPORTS", 2)
    uris = [build_buckets("photos", storage, unit_rows=unit_rows).units.detail_uri for unit_rows in (1, 2, 3)]
    kept = sorted(p.name for p in Path(storage.uri("_reports", "buckets", "photos")).iterdir())
    # and the record of the last commit, which downstream stages follow (unchanged.last_commit)
    assert kept == sorted([*(Path(u).name for u in uris[1:]), "latest.json"])



def test_a_forced_rerun_runs_again_and_leaves_what_follows_it_alone(storage: Storage) -> None:
    """`force_next_run` (`prx-corpus build --rerun`): the next run over unchanged inputs runs instead
    of standing on the last report, and `last_commit`, which the stages following it pin, stays as
    it was until that run commits."""
    assert not force_next_run(storage, "buckets", "photos")  # nothing committed yet
    first = build_buckets("photos", storage)
    followed = last_commit(storage, "buckets", "photos")
    assert build_buckets("photos", storage).units.ran == 0  # unchanged: the last report stands
    assert force_next_run(storage, "buckets", "photos") and last_commit(storage, "buckets", "photos") == followed
    assert not force_next_run(storage, "buckets", "photos")  # no report left to drop
    again = build_buckets("photos", storage)
    assert again.units.ran == first.units.ran > 0 and again.bucketed == first.bucketed
    assert build_buckets("photos", storage).units.ran == 0  # and the forced run's report stands in turn
