"""URL ingest a slow host cannot sink (issue 44, item 4), against the loopback server: a URL that
drips bytes then drops is not retried and costs at most its own deadline; one deadline per URL
across its attempts; the fetches of a reader's batches overlap (a sliding window, no barrier per
batch) within a byte budget; and a unit that runs out of time commits what it fetched and
rejects only the rest as `not_fetched`, with that cause in the summary's line."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
from http_server import PhotoServer, load_photos
from test_download import CAP, FAST, records, spec_for, url_table

from prx_core.sources.fetch.window import FetchWindow
from prx_core.sources.records import SeenKeys
from prx_core.sources.tables import TableFile, finish, prepare
from prx_core.stages.samples.refusals import refused_line
from prx_core.stages.samples.stage import build_samples
from prx_core.store import lance_io
from prx_core.store.storage import Storage

NAMES = list(load_photos())


def photo_rows(photo_server: PhotoServer, n: int, tag: str, slow: dict[int, str] | None = None) -> list[dict]:
    """`n` rows of photo URLs (unique per `tag`), the rows in `slow` at those paths instead."""
    slow = slow or {}
    return [{"key": f"k{i:04d}", "URL": photo_server.url(slow.get(i) or f"/photo/{NAMES[i % len(NAMES)]}/{tag}-{i}"),
             "TEXT": f"photo {i}"} for i in range(n)]


def requests_to(photo_server: PhotoServer, prefix: str) -> list[float]:
    return [r.at for r in photo_server.log if r.path.startswith(prefix)]


def test_a_url_that_drips_then_drops_is_not_retried(tmp_path: Path, photo_server: PhotoServer) -> None:
    url_table(tmp_path / "t", [[{"key": "a", "URL": photo_server.url("/drip/coffee/once?s=1.5"), "TEXT": "t"}]])
    settings = replace(FAST, read_timeout_s=5.0, retry_within_s=1.0, retries=3)
    (record,) = records(spec_for(tmp_path / "t", settings)).values()
    assert record["reject_reason"] == "download_error", record["reject_message"]
    assert "connection dropped 2 s into attempt 1, not retried" in record["reject_message"] or \
        "connection dropped 1 s into attempt 1, not retried" in record["reject_message"], record["reject_message"]
    assert photo_server.paths().count("/drip/coffee/once?s=1.5") == 1  # before: retried 3 times, each as long


def test_one_deadline_holds_a_url_across_all_its_attempts(tmp_path: Path, photo_server: PhotoServer) -> None:
    url_table(tmp_path / "t", [[{"key": "a", "URL": photo_server.url("/fail/deadline"), "TEXT": "t"}]])
    settings = replace(FAST, retries=10, backoff_s=0.4, url_deadline_s=1.5)  # 0.4 + 0.8 + 1.6 ... > 1.5 s
    (record,) = records(spec_for(tmp_path / "t", settings)).values()
    assert record["reject_reason"] == "download_timeout"
    assert record["reject_message"].startswith("not done within the URL deadline of 1.5 s (3 attempts)")
    assert photo_server.paths().count("/fail/deadline") == 3


def test_slow_urls_of_different_batches_are_fetched_at_once_not_batch_after_batch(
        tmp_path: Path, photo_server: PhotoServer, served_photos: dict[str, bytes]) -> None:
    """600 rows, 3 batches of 256, one URL dripping for 3 s in each: all three drip together. Batch after
    batch, the third would start 6 s after the first; overlapping, it starts before the first drip ends."""
    slow = {100: "/drip/astronaut/w0?s=3", 356: "/drip/coffee/w1?s=3", 590: "/drip/chelsea/w2?s=3"}
    url_table(tmp_path / "t", [photo_rows(photo_server, 600, "window", slow)])
    settings = replace(FAST, read_timeout_s=5.0, retry_within_s=0.5)
    got = records(spec_for(tmp_path / "t", settings))
    assert [k for k, r in got.items() if r["reject_reason"]] == ["k0100", "k0356", "k0590"]
    assert sum(1 for r in got.values() if r["image"]) == 597
    starts = requests_to(photo_server, "/drip/")[-3:]
    assert max(starts) - min(starts) < 3.0, "the third batch's slow URL waited for the first batch's"
    assert list(got) == [f"k{i:04d}" for i in range(600)]  # in order all the same


def test_the_window_holds_at_most_its_byte_budget_plus_the_fetches_in_flight(
        tmp_path: Path, photo_server: PhotoServer, served_photos: dict[str, bytes]) -> None:
    """Budget 300 kB (a few served_photos), a dripping URL first: the rows behind it are fetched and emitted
    as the budget allows, in order; nothing deadlocks."""
    spec = spec_for(tmp_path, replace(FAST, concurrency=4, window_bytes=300_000, read_timeout_s=5.0))
    rows = photo_rows(photo_server, 256, "budget", {0: "/drip/rocket/budget?s=1"})
    batches = [pa.RecordBatch.from_pylist(rows[i:i + 64]) for i in range(0, 256, 64)]
    where, seen = TableFile("t", str(tmp_path / "t.parquet")), SeenKeys()
    prepared = ((b, prepare(spec, b, where, n * 64, seen)) for n, b in enumerate(batches))
    with FetchWindow(spec.download, CAP) as window:
        out = list(window.stream(prepared, lambda b, r: finish(spec, b, r, where)))
        peak = window.peak
    keys = [k for b in out for k in b.column("source_key").to_pylist()]
    assert keys == [r["key"] for r in rows]
    assert sum(1 for b in out for image in b.column("image").to_pylist() if image) == 255
    assert peak <= 300_000 + 4 * max(len(p) for p in served_photos.values()), peak
    assert sum(len(p) for p in served_photos.values()) * 256 // len(served_photos) > 10 * 300_000  # it could have held far more


def test_a_unit_out_of_time_commits_what_it_fetched_and_rejects_the_rest(
        tmp_path: Path, photo_server: PhotoServer, ray_cluster) -> None:
    """200 rows, 3 URLs dripping for a minute, a unit time limit of 40 s: its fetching stops at
    32 s (FETCH_SHARE), the 197 others commit, the 3 are `not_fetched` (before: the unit was
    cancelled whole, 0 samples, and the summary blamed the format)."""
    slow = {60: "/drip/astronaut/unit?s=60", 120: "/drip/coffee/unit?s=60", 199: "/drip/chelsea/unit?s=60"}
    url_table(tmp_path / "laion", [photo_rows(photo_server, 200, "unit", slow)])
    settings = replace(FAST, read_timeout_s=20.0, attempt_timeout_s=120.0, url_deadline_s=120.0)
    started = time.monotonic()
    report = build_samples(spec_for(tmp_path / "laion", settings), Storage(str(tmp_path / "corpus")), unit_seconds=40)
    assert time.monotonic() - started < 40 + 30, "the unit was not stopped by its own deadline"
    assert (report.rows, report.rejected, report.reasons) == (197, 3, {"not_fetched": 3})
    rejects = lance_io.read_table(str(tmp_path / "corpus" / "lance" / "rejects.lance"), ["source_key", "message"])
    messages = dict(zip(rejects["source_key"].to_pylist(), rejects["message"].to_pylist()))
    assert sorted(messages) == ["k0060", "k0120", "k0199"]
    assert all(m.startswith("the unit's time for fetching ran out") for m in messages.values()), messages


def test_a_source_refused_for_lack_of_time_says_so() -> None:
    spec = spec_for(Path("/laion"))
    line = refused_line(spec, {"not_fetched": 3}, {"not_fetched": {"key": "k1", "message": "the unit's time ..."}})
    assert "not_fetched" in line and "units.samples_seconds" in line and "format" not in line.split("not_fetched")[1]
    cancelled = refused_line(spec, {"unreadable_fragment": 1}, {"unreadable_fragment": {
        "key": "part-0.parquet", "message": "TimeoutError: still running after 40 s, over the 40 s time limit; "
                                            "cancelled (after 0 rows)"}})
    assert "ran past its time limit" in cancelled and "check the source's format" not in cancelled
