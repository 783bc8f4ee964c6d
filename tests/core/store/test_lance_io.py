"""prx_core.store.lance_io against real Lance tables on disk (and on a moto S3 endpoint)."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_core.store import lance_io as lio
from prx_core.store import maintenance as maint
from prx_core.upkeep import compaction
from prx_core.store.storage import lance_storage_options

SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("value", pa.int64()),
                    ("caption", pa.string())])


def rows(source: str, n: int, tag: str = "v1") -> pa.Table:
    return pa.table({"sample_id": [f"{source}/{i}" for i in range(n)], "source": [source] * n,
                     "value": list(range(n)), "caption": [f"{tag} caption {i} of {source}" for i in range(n)]},
                    schema=SCHEMA)


def where(source: str) -> str:
    return f"source = {lio.sql_literal(source)}"


def content(uri: str, source: str | None = None, **kw: object) -> list[tuple]:
    table = lio.read_table(uri, filter=None if source is None else where(source), **kw)
    return sorted(zip(*(table[c].to_pylist() for c in SCHEMA.names)))


def content_of(table: pa.Table) -> list[tuple]:
    return sorted(zip(*(table[c].to_pylist() for c in SCHEMA.names)))


def files_of(uri: str, source: str) -> list[str]:
    """Data files of the fragments holding `source` (unchanged files = untouched rows)."""
    ds = lance.dataset(uri)
    return sorted(f.path for frag in ds.get_fragments() if frag.count_rows(where(source))
                  for f in frag.metadata.files)


def test_sql_literal_quotes(tmp_path: Path) -> None:
    uri = str(tmp_path / "q.lance")
    names = ["o'brien", "back\\slash", "x' OR '1'='1"]
    for name in names:
        lio.replace_partition(uri, where(name), rows(name, 2), SCHEMA)
    assert lio.sql_literal("o'brien") == "'o''brien'"
    for name in names:
        assert {r[1] for r in content(uri, name)} == {name}
    assert len(content(uri)) == 6
    with pytest.raises(ValueError):
        lio.sql_literal("a\x00b")


def test_missing_table(tmp_path: Path) -> None:
    uri = str(tmp_path / "nothing.lance")
    assert lio.open_table(uri) is None and lio.table_version(uri) is None and not lio.table_exists(uri)
    with pytest.raises(lio.TableNotFoundError, match="nothing.lance"):
        lio.read_table(uri)


def test_replace_one_partition_in_one_commit_idempotent(tmp_path: Path) -> None:
    uri = str(tmp_path / "samples.lance")
    for source, n in [("a", 30), ("b", 20), ("c", 10)]:
        lio.replace_partition(uri, where(source), rows(source, n), SCHEMA)
    others = {s: (content(uri, s), files_of(uri, s)) for s in "bc"}
    before = lio.table_version(uri)
    version = lio.replace_partition(uri, where("a"), rows("a", 25, "v2"), SCHEMA)
    assert version == before + 1 == lio.table_version(uri)
    assert content(uri, "a") == content_of(rows("a", 25, "v2"))
    assert {s: (content(uri, s), files_of(uri, s)) for s in "bc"} == others
    assert content(uri, "a", version=before) == content_of(rows("a", 30))  # old version still readable
    snapshot = content(uri)
    assert lio.replace_partition(uri, where("a"), rows("a", 25, "v2"), SCHEMA) == version + 1
    assert content(uri) == snapshot and len(snapshot) == 55  # same rows, no duplicates


def test_replace_after_compaction_mixed_sources(tmp_path: Path) -> None:
    uri = str(tmp_path / "mixed.lance")
    for source in "ab":
        frags = lio.write_fragments(uri, rows(source, 40), SCHEMA, max_rows_per_file=10)
        lio.replace_rows(uri, where(source), frags, SCHEMA)
    assert len(lance.dataset(uri).get_fragments()) == 8
    report = compaction.compact_table(uri, target_rows_per_fragment=1000)
    assert (report.fragments_before, report.fragments_after) == (8, 1)
    b_rows, before = content(uri, "b"), lio.table_version(uri)
    version = lio.replace_partition(uri, where("a"), rows("a", 5, "v2"), SCHEMA)
    assert version == before + 1
    assert content(uri, "a") == content_of(rows("a", 5, "v2")) and content(uri, "b") == b_rows
    mixed = lance.dataset(uri).get_fragments()[0].metadata
    assert mixed.deletion_file is not None and mixed.num_rows == 40  # b's rows kept, a's deleted
    health = maint.fragment_health(uri, target_rows=1000)
    assert health.deleted_rows == 40 and health.rows == 45


def test_crash_before_commit_leaves_previous_version(tmp_path: Path) -> None:
    uri = str(tmp_path / "crash.lance")
    lio.write_fragments(uri, rows("a", 10), SCHEMA)  # crashed before the first commit ever
    assert lio.open_table(uri) is None
    lio.replace_partition(uri, where("a"), rows("a", 10), SCHEMA)
    version, snapshot = lio.table_version(uri), content(uri)
    orphans = lio.write_fragments(uri, rows("a", 99, "lost"), SCHEMA)  # written, never committed
    assert orphans and lio.table_version(uri) == version and content(uri) == snapshot
    lio.replace_partition(uri, where("a"), rows("a", 3, "v2"), SCHEMA)
    assert content(uri) == content_of(rows("a", 3, "v2"))


def test_fragments_written_in_other_processes(tmp_path: Path) -> None:
    """Fragment metadata travels back from worker processes (as from Ray tasks) and commits."""
    uri = str(tmp_path / "parallel.lance")
    frags = lio.write_fragments(uri, rows("a", 5), SCHEMA)
    assert pickle.loads(pickle.dumps(frags)) == frags
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(lio.write_fragments, [uri] * 2,
                              [rows("a", 50).slice(0, 25), rows("a", 50).slice(25)], [SCHEMA] * 2))
    lio.replace_rows(uri, where("a"), [f for part in parts for f in part], SCHEMA)
    assert content(uri) == content_of(rows("a", 50)) and lio.table_version(uri) == 1


def materialize_concurrently(uri: str, sources: list[str], options: dict | None = None) -> None:
    """One thread per partition: write fragments, wait for all, then replace, as racing runs do."""
    barrier = threading.Barrier(len(sources))
    errors: list[BaseException] = []

    def materialize(source: str) -> None:
        try:
            frags = lio.write_fragments(uri, rows(source, 11, "new"), SCHEMA, options)
            barrier.wait()
            lio.replace_rows(uri, where(source), frags, SCHEMA, options)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=materialize, args=(s,)) for s in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    expected = sorted(r for s in sources for r in content_of(rows(s, 11, "new")))
    assert content(uri, storage_options=options) == expected


@pytest.mark.parametrize("layout", ["missing", "separate", "mixed"])
def test_concurrent_partitions_all_land(tmp_path: Path, layout: str) -> None:
    """Concurrent materializations of different partitions: a racing creation of the table,
    disjoint fragments (Lance rebases), one compacted fragment shared by all (real conflicts)."""
    sources = ["p0", "p1", "p2", "p3"]
    for attempt in range(3):
        uri = str(tmp_path / f"concurrent-{attempt}.lance")
        if layout != "missing":
            for source in sources:
                lio.replace_partition(uri, where(source), rows(source, 7, "old"), SCHEMA)
        if layout == "mixed":
            assert compaction.compact_table(uri, target_rows_per_fragment=1000).fragments_after == 1
        materialize_concurrently(uri, sources)


def test_upsert_updates_and_never_shrinks(tmp_path: Path) -> None:
    uri = str(tmp_path / "captions.lance")
    keys = ["sample_id", "source"]
    assert lio.upsert(uri, rows("a", 10), keys) == 1
    version = lio.upsert(uri, rows("a", 15, "v2").slice(5), keys)  # 5 matched, 5 new
    assert version == 2
    got = {r[0]: r[3] for r in content(uri)}
    assert len(got) == 15 and got["a/3"].startswith("v1") and got["a/7"].startswith("v2")
    lio.upsert(uri, rows("a", 1, "v3"), keys)
    assert len(content(uri)) == 15 and {r[0]: r[3] for r in content(uri)}["a/0"].startswith("v3")
    assert [f.name() for f in lance.dataset(uri).lance_schema.unenforced_primary_key()] == keys


def test_concurrent_upserts_of_the_same_new_keys_do_not_duplicate(tmp_path: Path) -> None:
    """Two sources captioning the same content at once (shared `captions` table)."""
    for attempt in range(3):
        uri = str(tmp_path / f"shared-{attempt}.lance")
        lio.upsert(uri, rows("seed", 1), ["sample_id"])  # no key in common: pure inserts race
        barrier = threading.Barrier(3)
        errors: list[BaseException] = []

        def run(tag: str) -> None:
            barrier.wait()
            try:
                lio.upsert(uri, rows("a", 40, tag), ["sample_id"])
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert sorted(r[0] for r in content(uri)) == sorted(["seed/0"] + [f"a/{i}" for i in range(40)])


def test_a_table_older_than_its_schema_gains_the_new_nullable_columns(tmp_path: Path) -> None:
    """Appended nullable columns (e.g. `samples.phash`) reach an existing corpus as nulls; the
    upgrade must come before workers write fragments, which must match the table's schema."""
    uri = str(tmp_path / "samples.lance")
    lio.replace_partition(uri, where("a"), rows("a", 3), SCHEMA)
    lio.replace_partition(uri, where("b"), rows("b", 2), SCHEMA)
    wider = SCHEMA.append(pa.field("phash", pa.uint64()))
    with pytest.raises(OSError, match="different schema"):
        lio.write_fragments(uri, rows("a", 1).append_column("phash", pa.array([7], pa.uint64())), wider)
    lio.upgrade_table(uri, wider)
    new_a = rows("a", 2, tag="v2").append_column("phash", pa.array([7, 8], pa.uint64()))
    lio.replace_rows(uri, where("a"), lio.write_fragments(uri, new_a, wider), wider)
    table = lio.read_table(uri, columns=["sample_id", "phash"])
    assert sorted(zip(*table.to_pydict().values())) == [("a/0", 7), ("a/1", 8), ("b/0", None), ("b/1", None)]
    with pytest.raises(ValueError, match="differs from the writer"):  # not an appended column: refused
        lio.upgrade_table(uri, pa.schema([("sample_id", pa.string()), ("source", pa.int64())]))


def test_overwrite(tmp_path: Path) -> None:
    uri = str(tmp_path / "duplicates.lance")
    assert lio.overwrite(uri, rows("a", 4)) == 1
    assert lio.overwrite(uri, rows("b", 2)) == 2
    assert content(uri) == content_of(rows("b", 2))


def test_fragment_health(tmp_path: Path) -> None:
    demo = str(tmp_path / "demo.lance")
    lio.replace_partition(demo, where("a"), rows("a", 50), SCHEMA)
    assert not maint.fragment_health(demo).needs_compaction
    many = str(tmp_path / "many.lance")
    for i in range(20):
        lio.replace_partition(many, where(f"s{i}"), rows(f"s{i}", 10), SCHEMA)
    health = maint.fragment_health(many, target_rows=1000)
    assert (health.fragments, health.rows, health.small_fragments, health.small_ratio) == (20, 200, 20, 1.0)
    assert health.needs_compaction
    report = compaction.compact_table(many, target_rows_per_fragment=1000, cleanup_older_than=timedelta(0))
    assert (report.fragments_before, report.fragments_after) == (20, 1)
    assert report.versions_removed >= 20 and report.bytes_removed > 0
    assert not maint.fragment_health(many, target_rows=1000).needs_compaction
    assert len(content(many)) == 200


def test_s3_round_trip(s3_endpoint: dict) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="lance-io")
    options = lance_storage_options(s3_endpoint["storage_options"])
    uri = "s3://lance-io/corpus/lance/samples.lance"
    assert lio.open_table(uri, options) is None
    for source in "ab":
        lio.replace_partition(uri, where(source), rows(source, 12), SCHEMA, options)
    frags = lio.write_fragments(uri, rows("a", 4, "v2"), SCHEMA, options)
    assert lio.table_version(uri, options) == 2  # written, not committed yet
    assert lio.replace_rows(uri, where("a"), frags, SCHEMA, options) == 3
    got = content(uri, storage_options=options)
    assert got == sorted(content_of(rows("a", 4, "v2")) + content_of(rows("b", 12)))
    assert lio.upsert(uri, rows("c", 2), ["sample_id"], options) == 4
    assert maint.fragment_health(uri, storage_options=options).rows == 18
    materialize_concurrently("s3://lance-io/corpus/lance/racing.lance", ["p0", "p1", "p2"], options)
