"""Batched appends to a shared table (prx_core.upkeep.appends) on a real local Ray and a real Lance
table: the indexes are caught up every few appends, so a unit looks its keys up in what the run
appended before it through the index, not by scanning every fragment appended since it began."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from prx_core.store import lance_io, schemas
from prx_core.store.maintenance import _unindexed_fragments
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend, append_fragments

pytestmark = pytest.mark.usefixtures("ray_cluster")


def unit_summary(storage: Storage, unit: int, rows: int = 3) -> dict:
    """What a labels unit reports: its rows written as an uncommitted fragment."""
    data = pa.table({"content_id": [f"c{unit:03d}-{i}" for i in range(rows)], "captioner_version": ["cap"] * rows,
                     "labeler_version": ["lab"] * rows, "labeler_id": ["l"] * rows, "label": ["none"] * rows,
                     "score": pa.array([0.5] * rows, pa.float32())}, schema=schemas.CAPTION_LABELS)
    written = lance_io.write_fragments(storage.lance_uri("caption_labels"), data, schemas.CAPTION_LABELS)
    return {"fragments": [f.to_json() for f in written]}


def unindexed(storage: Storage) -> int:
    ds = lance_io.require_table(storage.lance_uri("caption_labels"))
    (index,) = [d for d in ds.describe_indices() if d.name == "content_id_btree"]
    return len(_unindexed_fragments(ds, index))


def test_indexes_are_caught_up_every_few_appends(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    appends = BatchedAppend(storage, "caption_labels", every_units=1, index_every=3)
    seen = []
    for unit in range(9):
        appends.add(unit_summary(storage, unit))  # every_units=1: one append per unit
        if unit >= 2:
            seen.append(unindexed(storage))
    assert appends.appends == 9
    assert seen == [0, 1, 2, 0, 1, 2, 0]  # indexed at the 3rd, 6th and 9th append: never more than 2 behind
    table = lance_io.require_table(storage.lance_uri("caption_labels"))
    assert table.count_rows("content_id IN ('c004-1', 'c007-2')") == 2
    appends.finish()
    assert unindexed(storage) == 0


def test_a_runs_unit_fragments_are_merged_and_no_other_writers(tmp_path: Path) -> None:
    """Hazard 7: a fragment per unit would leave a shared table with ~244k fragments at 1B rows;
    every `index_every` appends the run's own fragments are merged (on a worker), another
    writer's fragment appended in between is left as it is, and every row stays once."""
    storage = Storage(str(tmp_path / "corpus"))
    uri = storage.lance_uri("caption_labels")
    appends = BatchedAppend(storage, "caption_labels", every_units=1, index_every=3, merge_rows=5)
    for unit in range(8):
        appends.add(unit_summary(storage, unit))
        if unit == 4:  # another source's run appends to the shared table meanwhile
            other = lance_io.fragments_from_json(unit_summary(storage, 100)["fragments"])
            append_fragments(uri, other, schemas.CAPTION_LABELS)
    appends.finish()
    ds = lance_io.require_table(uri)
    rows = sorted(ds.to_table(columns=["content_id"])["content_id"].to_pylist())
    assert rows == sorted([f"c{u:03d}-{i}" for u in [*range(8), 100] for i in range(3)])
    sizes = sorted(f.count_rows() for f in ds.get_fragments())
    # units 0-2 -> 9 rows in fragments of <= 5 (5 + 4), units 3-5 idem, units 6-7 at finish (5 + 1); the other's 3
    assert sizes == [1, 3, 4, 4, 5, 5, 5] and appends.merges == 3
    assert unindexed(storage) == 0


def test_merging_can_be_turned_off(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    appends = BatchedAppend(storage, "caption_labels", every_units=1, index_every=2, merge_rows=0)
    for unit in range(4):
        appends.add(unit_summary(storage, unit))
    appends.finish()
    assert len(lance_io.require_table(storage.lance_uri("caption_labels")).get_fragments()) == 4
    assert appends.merges == 0


def test_merging_and_indexing_go_on_while_actors_hold_every_cpu(tmp_path: Path, ray_cluster) -> None:
    """A stage's CPU model actors take every CPU of the cluster for the whole phase; the merges and
    index catch-ups of its batched appends happen during it, so they must not wait for a CPU (the
    actors would wait for the driver, which would wait for them)."""
    import threading

    @ray_cluster.remote(num_cpus=ray_cluster.cluster_resources()["CPU"])
    class Hog:
        def ping(self) -> bool:
            return True

    hog = Hog.remote()
    assert ray_cluster.get(hog.ping.remote())  # every CPU is held from here on
    storage = Storage(str(tmp_path / "corpus"))
    appends = BatchedAppend(storage, "caption_labels", every_units=1, index_every=2, merge_rows=100)
    done = threading.Event()

    def append_all() -> None:
        for unit in range(4):
            appends.add(unit_summary(storage, unit))
        appends.finish()
        done.set()

    worker = threading.Thread(target=append_all, daemon=True)
    worker.start()
    try:
        assert done.wait(180), "a merge or an index catch-up waited for a CPU the actors hold"
    finally:
        ray_cluster.kill(hog)
    assert appends.merges == 2 and unindexed(storage) == 0
    assert len(lance_io.require_table(storage.lance_uri("caption_labels")).get_fragments()) == 2
