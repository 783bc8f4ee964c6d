"""The explorer stage follows its own source only: a rerun after other sources' samples, captions
and duplicate groups moved every shared table commits nothing, and a rerun after another source's
copy joined one of its pictures' groups rebuilds it with the group shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpora import write_captions, write_contents
from dup_rows import write_source

from prx_core.stages.duplicates.stage import build_duplicates
from prx_core.stages.explorer.stage import build_explorer
from prx_core.store import lance_io
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")

VERSIONS = {"captioner_version": "cap-v1", "labeler_version": "lab-v1"}


def add_source(storage: Storage, source: str, pictures: list[int]) -> None:
    """`source` with one sample per picture (content = picture), its pHash rows and captions."""
    keys = [f"k{p}" for p in pictures]
    write_contents(storage, source, {k: f"{source}-{k}".encode() for k in keys})
    write_source(storage, source, [(k, p, 0 if source == "a" else 1, 400, 90, 20) for k, p in zip(keys, pictures)])
    write_captions(storage, "cap-v1", {f"{k}": f"a photo of picture {k}" for k in keys})


def explorer_rows(storage: Storage) -> dict[str, dict]:
    rows = lance_io.require_table(storage.lance_uri("explorer")).to_table(filter="source = 'a'").to_pylist()
    return {r["sample_id"]: r for r in rows}


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "root"))
    add_source(storage, "a", [1, 2, 3])
    build_duplicates(storage)
    return storage


def test_another_sources_runs_leave_the_explorer_as_it_was(storage: Storage) -> None:
    first = build_explorer("a", storage, **VERSIONS)
    assert first.rows == 3 and first.units["samples"].ran == 1
    moved = {t: lance_io.table_version(storage.lance_uri(t)) for t in ("samples", "phashes", "captions", "duplicates")}
    add_source(storage, "b", [7, 8])  # new pictures: every shared table moves, nothing of `a` changes
    build_duplicates(storage)
    assert all(lance_io.table_version(storage.lance_uri(t)) > v for t, v in moved.items())
    again = build_explorer("a", storage, **VERSIONS)
    assert again.units["samples"].ran == 0 and again.units["samples"].skipped == 1
    assert again.explorer_version == first.explorer_version  # nothing committed


def test_a_copy_joining_its_group_rebuilds_it(storage: Storage) -> None:
    build_explorer("a", storage, **VERSIONS)
    assert all(r["group_id"] is None for r in explorer_rows(storage).values())
    add_source(storage, "b", [2])  # a copy of a's picture 2
    build_duplicates(storage)
    rebuilt = build_explorer("a", storage, **VERSIONS)
    assert rebuilt.units["samples"].ran == 1
    rows = explorer_rows(storage)
    assert rows["a/k2"]["group_size"] == 2 and rows["a/k1"]["group_id"] is None


def test_its_own_new_rows_rebuild_it(storage: Storage) -> None:
    build_explorer("a", storage, **VERSIONS)
    add_source(storage, "a", [1, 2, 3, 4])  # the source re-ingested with one more picture
    rebuilt = build_explorer("a", storage, **VERSIONS)
    assert rebuilt.units["samples"].ran == 1 and rebuilt.rows == 4
