"""Retention is aged from supersession, not creation, and never removes what a reader still holds:
MDS chunks an index dropped outlive it by the retention (a real mosaicml-streaming reader
holding the old index.json keeps reading), and Lance versions go only once the version after them
is the retention old and no uncommitted stage attempt pinned them. Old times are faked by old
file mtimes (what the write-time rule read) and by the clock `prx_core` reads
(`prx_core.shards.mds.retention.time`, `prx_core.store.retention.time`)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lance
import pytest
import streaming
from PIL import Image
from skimage import data as skdata
from streaming.base.util import clean_stale_shared_memory
from test_lance_io import SCHEMA, rows, where
from test_mds import B512, B1024, make_rows

from prx_core.compute.units import Manifest, UnitRun
from prx_core.shards.mds import retention as mds_retention
from prx_core.shards.mds.publish import write_source_streams
from prx_core.shards.mds.read import read_stream_rows, verify_stream
from prx_core.shards.mds.retention import RETENTION_SECONDS, prune_streams
from prx_core.store import lance_io as lio
from prx_core.store import retention as lance_retention
from prx_core.store.storage import Storage
from prx_core.upkeep import compaction

DAY = 24 * 3600


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    return [Image.fromarray(getattr(skdata, n)()).convert("RGB") for n in ("astronaut", "chelsea", "coffee")]


def age_files(folder: Path, seconds: float) -> None:
    """Make every file under `folder` look written `seconds` ago (what a write-time rule reads)."""
    stamp = time.time() - seconds
    for path in folder.rglob("*"):
        os.utime(path, (stamp, stamp))


def fake_clock(monkeypatch, module: object, now: float) -> None:
    monkeypatch.setattr(module, "time", SimpleNamespace(time=lambda: now))


def chunk_folders(stream: str) -> set[str]:
    return {p.name for p in Path(stream).iterdir() if p.is_dir()}


def test_a_stream_republished_after_the_retention_keeps_its_old_chunks_for_a_reader(photos, tmp_path) -> None:
    root = str(tmp_path / "corpus")
    (first,) = write_source_streams(make_rows(photos, [B512] * 4), root, "alpha")
    age_files(tmp_path / "corpus", 8 * DAY)  # published 8 days ago, more than the 7-day retention
    old_rows = [(r["sample_id"], hashlib.sha256(r["image"]).hexdigest()) for r in read_stream_rows(first.uri)]
    clean_stale_shared_memory()
    reader = streaming.StreamingDataset(remote=first.uri, local=str(tmp_path / "trainer"), shuffle=False, batch_size=1)
    rows_b = make_rows(photos, [B512] * 5)
    (second,) = write_source_streams(rows_b, root, "alpha")  # republished now
    assert set(second.chunks).isdisjoint(first.chunks)
    record = json.loads(Path(second.uri, "superseded.json").read_text())["superseded"]
    assert set(record) == set(first.chunks) and all(abs(t - time.time()) < 600 for t in record.values())

    report = prune_streams(root)  # the next compact_corpus: the write-time rule removed the old chunk here
    assert report.removed == [] and report.kept_recent == 1
    read = [reader[i]["sample_id"] for i in range(reader.num_samples)]  # fetches every old shard
    assert read == [sid for sid, _ in old_rows]
    del reader

    assert prune_streams(root, now=time.time() + 6 * DAY).removed == []  # superseded 6 days ago: kept
    later = prune_streams(root, now=time.time() + RETENTION_SECONDS + 60)
    assert [Path(p).name for p in later.removed] == first.chunks
    assert chunk_folders(second.uri) == set(second.chunks) and not Path(second.uri, "superseded.json").exists()
    assert verify_stream(second.uri, expected_sha256=second.image_sha256).ok


def test_an_unpublished_stream_and_a_crashed_writers_chunk_age_from_when_they_were_seen(photos, tmp_path,
                                                                                         monkeypatch) -> None:
    root = str(tmp_path)
    write_source_streams(make_rows(photos, [B512, B1024]), root, "alpha")
    age_files(tmp_path, 30 * DAY)
    start = time.time()
    (kept,) = write_source_streams(make_rows(photos, [B512]), root, "alpha")  # the 1024 bucket is gone
    gone = Path(root, "mds", "alpha", "1024", "1024x1024")
    assert not (gone / "index.json").exists() and (gone / "superseded.json").exists()
    leftover = Path(kept.uri, "c-crashedwriter000000")  # a chunk no publish ever referenced
    leftover.mkdir()
    (leftover / "shard.00000.mds").write_bytes(b"half written")
    age_files(leftover, 30 * DAY)

    fake_clock(monkeypatch, mds_retention, start + DAY)
    first = prune_streams(root)  # records the leftover as unreferenced since now; removes nothing
    assert first.removed == [] and first.kept_recent == 2
    unpublished = sorted(str(p) for p in gone.iterdir() if p.is_dir())
    assert sorted(prune_streams(root, now=start + RETENTION_SECONDS + 60).removed) == unpublished
    assert leftover.exists()  # seen unreferenced one day later than the unpublished chunks
    assert [Path(p).name for p in prune_streams(root, now=start + DAY + RETENTION_SECONDS + 60).removed] == [leftover.name]


def test_a_chunk_referenced_again_leaves_the_record(photos, tmp_path, monkeypatch) -> None:
    root = str(tmp_path)
    rows_a, rows_b = make_rows(photos, [B512] * 3), make_rows(photos, [B512] * 4)
    start = time.time()
    fake_clock(monkeypatch, mds_retention, start)
    (a,) = write_source_streams(rows_a, root, "alpha")
    fake_clock(monkeypatch, mds_retention, start + DAY)
    (b,) = write_source_streams(rows_b, root, "alpha")  # a's chunk superseded at day 1
    fake_clock(monkeypatch, mds_retention, start + 9 * DAY)
    (again,) = write_source_streams(rows_a, root, "alpha")  # back to a: its content-named chunk reused
    assert again.chunks == a.chunks
    record = json.loads(Path(a.uri, "superseded.json").read_text())["superseded"]
    assert record == {b.chunks[0]: start + 9 * DAY}  # a's day-1 entry gone, b's from day 9
    report = prune_streams(root, now=start + 10 * DAY)
    assert report.removed == [] and chunk_folders(a.uri) == {*a.chunks, *b.chunks}
    assert [Path(p).name for p in prune_streams(root, now=start + 17 * DAY).removed] == b.chunks


def lance_versions(uri: str) -> list[int]:
    return [v["version"] for v in lance.dataset(uri).versions()]


def committed_at(uri: str, version: int) -> float:
    return next(v["timestamp"].timestamp() for v in lance.dataset(uri).versions() if v["version"] == version)


def test_a_lance_version_created_long_ago_but_superseded_now_survives_compaction(tmp_path, monkeypatch) -> None:
    uri = str(tmp_path / "t.lance")
    retention = timedelta(seconds=3)
    v1 = lio.replace_partition(uri, where("a"), rows("a", 10), SCHEMA)
    time.sleep(retention.total_seconds() + 0.5)  # v1 is older than the retention (Lance's own clock)
    v2 = lio.replace_partition(uri, where("a"), rows("a", 10, "v2"), SCHEMA)
    fake_clock(monkeypatch, lance_retention, committed_at(uri, v2) + 0.1)  # cleanup right after v2
    report = compaction.compact_table(uri, target_rows_per_fragment=1000, cleanup_older_than=retention)
    assert v1 in lance_versions(uri) and report.versions_removed == 0 and report.versions_kept_recent >= 1
    pinned_reader = lance.dataset(uri, version=v1)  # a stage pinned to the previous version still reads it
    assert sorted(pinned_reader.to_table()["value"].to_pylist()) == sorted(rows("a", 10)["value"].to_pylist())
    fake_clock(monkeypatch, lance_retention, time.time() + 60)  # a minute past the retention of v2
    later = compaction.compact_table(uri, target_rows_per_fragment=1000, cleanup_older_than=retention)
    assert v1 not in lance_versions(uri) and later.versions_removed >= 1


def test_a_lance_version_pinned_by_an_uncommitted_attempt_is_never_removed(tmp_path, monkeypatch) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    uri = storage.lance_uri("samples")
    v1 = lio.replace_partition(uri, where("a"), rows("a", 10), SCHEMA)
    run = UnitRun.open(storage, Manifest("phashes", "a", {"samples": v1, "note": "x", "flag": True}, "1"))
    v2 = lio.replace_partition(uri, where("a"), rows("a", 10, "v2"), SCHEMA)
    lio.replace_partition(uri, where("a"), rows("a", 10, "v3"), SCHEMA)
    assert lance_retention.pinned_versions(storage) == {"samples": {v1}}
    fake_clock(monkeypatch, lance_retention, time.time() + 30 * DAY)  # everything superseded long ago
    report = compaction.compact_table(uri, target_rows_per_fragment=1000,
                                 pinned_versions=lance_retention.pinned_versions(storage)["samples"])
    assert v1 in lance_versions(uri) and v2 not in lance_versions(uri) and report.versions_kept_pinned == 1
    assert lance.dataset(uri, version=v1).count_rows() == 10  # the attempt can still resume on it

    run.finish()  # committed: it reads its inputs no more
    assert lance_retention.pinned_versions(storage) == {}
    compaction.compact_table(uri, target_rows_per_fragment=1000, pinned_versions=())
    assert lance_versions(uri) == [lance.dataset(uri).version]


def test_a_damaged_run_record_stops_the_cleanup_naming_it(tmp_path) -> None:
    storage = Storage(str(tmp_path))
    run = UnitRun.open(storage, Manifest("phashes", "a", {"samples": 3}, "1"))
    Path(run.uri, "run.json").write_text("{not json")
    with pytest.raises(ValueError, match="run.json: unreadable run record"):
        lance_retention.pinned_versions(storage)


def test_removable_versions_age_from_the_successor() -> None:
    versions = [{"version": 1, "timestamp": 0.0}, {"version": 2, "timestamp": 100.0},
                {"version": 3, "timestamp": 140.0}, {"version": 5, "timestamp": 195.0}]
    removable, pinned, recent = lance_retention.removable_versions(versions, 50, {1}, now=200.0)
    assert (removable, pinned, recent) == ([2], [1], [3])  # 2 superseded 60 s ago; 5, the latest, never listed


def test_finding_streams_lists_folders_not_shards(photos, tmp_path, monkeypatch) -> None:
    """Streams are found a level at a time (sources, tiers, buckets): never a recursive listing of
    `mds/`, which returns every shard of the corpus (millions at 1B images)."""
    import fsspec.implementations.local as local

    root = str(tmp_path)
    write_source_streams(make_rows(photos, [B512, B1024]), root, "alpha")
    write_source_streams(make_rows(photos, [B512], source="beta"), root, "beta")
    Path(root, "mds", ".tmp-upload").mkdir()  # a hidden folder and a non-stream file are no streams
    Path(root, "mds", "alpha", "README").write_text("x")

    def no_find(*args, **kwargs):
        raise AssertionError("a recursive listing of mds/")

    monkeypatch.setattr(local.LocalFileSystem, "find", no_find)
    report = prune_streams(root)
    assert report.streams == 3 and report.removed == []
    assert prune_streams(root, source="beta").streams == 1
