"""Takedowns that stay down (issue 44, item 3), below the CLI: the recorded ids come back as the
keys an ingest unit refuses; a URL table's taken-down row is never fetched (the loopback
server's log); a file source's is read but never kept; the samples stage counts them. (Through
the CLI on a real corpus: tests/e2e/test_operations.py, a re-ingest after a takedown.)"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from http_server import PhotoServer
from test_download import records, spec_for, url_table

from prx_core.sources.ingest import ingest_batch
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.sources.records import RECORD_SCHEMA, record
from prx_core.sources.tables import ReadGuard
from prx_core.stages.opt_out.takedowns import record_takedowns, taken_down_ids, taken_down_keys
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage


def test_recorded_takedowns_are_read_back_per_source(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    assert taken_down_keys(storage, "laion") == frozenset()
    record_takedowns(storage, "laion", "run1", [pa.array(["laion/a", "laion/b/c"])])
    record_takedowns(storage, "laion", "run2", [pa.array(["laion/a"]), pa.array(["laion/d"])])
    record_takedowns(storage, "other", "run2", [pa.array(["other/a"])])
    assert record_takedowns(storage, "laion", "run3", [pa.array([], pa.string())]) is None
    assert sorted(taken_down_ids(storage, "laion").to_pylist()) == ["laion/a", "laion/b/c", "laion/d"]
    assert taken_down_keys(storage, "laion") == {"a", "b/c", "d"}


def test_a_taken_down_url_is_refused_before_it_is_fetched(tmp_path: Path, photo_server: PhotoServer) -> None:
    rows = [{"key": k, "URL": photo_server.url(f"/photo/{n}/takedown-{k}"), "TEXT": "t"}
            for k, n in (("kept", "astronaut"), ("gone", "coffee"))]
    url_table(tmp_path / "t", [rows])
    spec = spec_for(tmp_path / "t")
    photo_server.clear()
    got = {}
    for fragment, _ in fragment_sizes(spec):
        for batch in read_fragment(spec, fragment, None, ReadGuard(taken_down=frozenset({"gone"}))):
            got.update({r["source_key"]: r for r in batch.to_pylist()})
    assert got["gone"]["reject_reason"] == "taken_down" and not got["gone"]["image"]
    assert got["kept"]["reject_reason"] is None
    assert photo_server.paths() == ["/photo/astronaut/takedown-kept"]  # the taken-down URL was never asked for
    assert records(spec)["gone"]["reject_reason"] is None  # without the guard it would be fetched


def test_a_file_sources_taken_down_key_is_never_kept(served_photos: dict[str, bytes]) -> None:
    batch = pa.RecordBatch.from_pylist([record("img/a", served_photos["astronaut"], "a"),
                                        record("img/b", served_photos["coffee"], "b")], schema=RECORD_SCHEMA)
    samples, rejects = ingest_batch("folder", batch, taken_down=frozenset({"img/b"}))
    assert samples["sample_id"].to_pylist() == ["folder/img/a"]
    assert rejects.select(["sample_id", "reason", "content_id"]).to_pylist() == [
        {"sample_id": "folder/img/b", "reason": "taken_down", "content_id": None}]


def test_the_samples_stage_refuses_recorded_takedowns_and_counts_them(
        tmp_path: Path, photo_server: PhotoServer, ray_cluster) -> None:
    rows = [{"key": f"k{i}", "URL": photo_server.url(f"/photo/{n}/stage-{i}"), "TEXT": "t"}
            for i, n in enumerate(["astronaut", "coffee", "chelsea"])]
    url_table(tmp_path / "laion", [rows])
    storage = Storage(str(tmp_path / "corpus"))
    record_takedowns(storage, "laion", "run1", [pa.array(["laion/k1"])])
    photo_server.clear()
    report = build_samples(spec_for(tmp_path / "laion"), storage)
    assert (report.rows, report.reasons) == (2, {"taken_down": 1})
    assert "/photo/coffee/stage-1" not in photo_server.paths()


def test_a_purge_deletes_the_taken_down_keys_from_the_staged_joins(tmp_path: Path) -> None:
    """A staged join (`_state/joins/<source>/<digest>.lance`, BTREE on its key) holds the joined
    captions of taken-down keys: they go, index and old versions included."""
    import lance

    from prx_core.stages.opt_out.purge import PurgeReport, purge_source

    storage = Storage(str(tmp_path / "corpus"))
    staged = tmp_path / "corpus" / "_state" / "joins" / "laion" / "abc.lance"
    rows = pa.table({"key": ["k0", "k1", "secret-key"], "caption": ["a", "b", "a caption to take down"]})
    lance.write_dataset(rows, str(staged)).create_scalar_index("key", "BTREE", name="key_btree")
    record_takedowns(storage, "laion", "run1", [pa.array(["laion/secret-key"])])
    report = PurgeReport()
    purge_source(storage, "laion", False, [], report)
    assert report.join_rows == 1 and report.complete
    assert sorted(lance.dataset(str(staged)).to_table()["key"].to_pylist()) == ["k0", "k1"]
    assert not [p for p in staged.rglob("*") if p.is_file() and b"secret-key" in p.read_bytes()]
    assert not [p for p in staged.rglob("*") if p.is_file() and b"a caption to take down" in p.read_bytes()]
