"""The explorer's pages are Lance queries over the `explorer` table and its facet counts: a
filtered page is what the same Lance filter returns, the menus read from `explorer_facets` are
the counts of the rows themselves, a corpus without the explorer's tables says what to
materialize (never a 500), and a new `explorer` version shows without a restart."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import lance
import pyarrow as pa
import pytest
from starlette.testclient import TestClient

from prx_core.store.storage import Storage
from prx_explorer import facets as facets_module
from prx_explorer.app import create_app
from prx_explorer.search import PAGE_SIZE
from prx_explorer.view import FIX
from test_app import all_ids, search, wait_for

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus

MENU_COLUMNS = {"source": "source", "label": "label", "tier": "tier", "bucket": "bucket", "group": "group_id",
                "skipped": "skip_reason", "rejected": "reject_reason", "meta": "meta_label", "caption": "caption_problem"}


def explorer_rows(root: Path, where: str | None = None) -> list[dict]:
    """The explorer table's rows matching `where`, read by Lance directly, in table order."""
    return lance.dataset(Storage(str(root)).lance_uri("explorer")).to_table(filter=where).to_pylist()


def counted(rows: list[dict]) -> dict[str, dict[str, int]]:
    """menu -> value -> rows, counted here in Python: skip reasons one by one, metadata labels as filters."""
    out: dict[str, Counter] = {name: Counter() for name in MENU_COLUMNS}
    for row in rows:
        for name, column in MENU_COLUMNS.items():
            value = row[column]
            if value is None or value == "":
                continue
            values = str(value).split(",") if name == "skipped" else [str(value)]
            out[name].update(f"label:{v}" if name == "meta" else v for v in values)
    return {name: dict(c) for name, c in out.items()}


def menus_of(body: dict) -> dict[str, dict[str, int]]:
    return {name: dict(map(tuple, pairs)) for name, pairs in body["facets"].items()}


@pytest.mark.parametrize("params, where", [
    ({"source": "web_images", "tier": "1024"}, "source = 'web_images' AND tier = 1024"),
    ({"rejected": "yes"}, "reject_reason IS NOT NULL"),
    ({"label": "visual", "skipped": "no"}, "label = 'visual' AND skip_reason IS NULL"),
    ({}, None),
])
def test_a_filtered_page_is_what_the_lance_filter_returns(client: TestClient, explorer_corpus: ExplorerCorpus,
                                                          params: dict, where: str | None) -> None:
    direct = [r["sample_id"] for r in explorer_rows(explorer_corpus.root, where)]
    assert direct, where
    first = search(client, **params)
    assert first["total"] == len(direct)
    assert [r["sample_id"] for r in first["rows"]] == direct[:PAGE_SIZE]  # the same rows, in table order
    assert all_ids(client, **params) == direct


def test_a_skip_reason_matches_each_reason_of_a_joined_set(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    rows = explorer_rows(explorer_corpus.root, "skip_reason IS NOT NULL")
    reasons = {reason for r in rows for reason in r["skip_reason"].split(",")}
    assert reasons
    for reason in reasons:
        want = {r["sample_id"] for r in rows if reason in r["skip_reason"].split(",")}
        assert set(all_ids(client, skipped=reason)) == want, reason


@pytest.mark.parametrize("source", ["", "stock_photos"])
def test_the_menus_from_the_facets_table_are_the_rows_counts(explorer_corpus: ExplorerCorpus, source: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_scan(*args: object) -> None:
        raise AssertionError("a query narrowed to a source at most reads the facets table, not the rows")

    monkeypatch.setattr(facets_module, "scanned_counts", no_scan)
    client = TestClient(create_app(Storage(str(explorer_corpus.root))), base_url="http://localhost")
    body = search(client, **({"source": source} if source else {}))
    rows = explorer_rows(explorer_corpus.root, f"source = '{source}'" if source else None)
    assert all(len(pairs) < facets_module.FACET_VALUES for pairs in body["facets"].values())  # nothing cut off
    assert menus_of(body) == counted(rows) and body["notes"] == []
    assert [int(t) for t, _ in body["facets"]["tier"]] == sorted(int(t) for t, _ in body["facets"]["tier"])


@pytest.mark.parametrize("source", ["", "stock_photos"])
def test_a_text_search_reads_no_hit_rows_for_its_menus(explorer_corpus: ExplorerCorpus, source: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Its menus count the corpus (or the chosen source), from the facets table: reading every
    hit's columns cost ~1 s at 100M rows. The page still shows only hits of the filter."""
    def no_rows(*args: object) -> None:
        raise AssertionError("a text search's menus read the facets table, not its hits' rows")

    monkeypatch.setattr(facets_module, "scanned_counts", no_rows)
    monkeypatch.setattr(facets_module, "row_counts", no_rows)
    client = TestClient(create_app(Storage(str(explorer_corpus.root))), base_url="http://localhost")
    body = search(client, q="photo", **({"source": source} if source else {}))
    assert body["total"] > 0 and body["menus_count"] == "corpus" and body["notes"] == []
    assert menus_of(body) == counted(explorer_rows(explorer_corpus.root, f"source = '{source}'" if source else None))
    assert all(r["source"] == source for r in body["rows"]) if source else body["rows"]
    page = client.get("/", params={"q": "photo"}).text
    assert "the menus count the corpus, not the matches" in page
    assert search(client)["menus_count"] == "matches"  # a browse counts what it shows


def test_the_menus_of_a_filter_count_its_rows_and_say_when_capped(client: TestClient, explorer_corpus: ExplorerCorpus,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    body = search(client, label="visual")
    assert menus_of(body) == counted(explorer_rows(explorer_corpus.root, "label = 'visual'")) and body["notes"] == []
    monkeypatch.setattr(facets_module, "FACET_SCAN", 10)
    fresh = TestClient(create_app(Storage(str(explorer_corpus.root))), base_url="http://localhost")  # no cached menus
    capped = search(fresh, label="visual")
    assert capped["notes"] == ["Menu counts are counts of the first 10 matches."]
    assert sum(n for _, n in capped["facets"]["label"]) == 10 and capped["total"] == body["total"]


def test_text_search_filters_before_ranking(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    """A filter is the search's prefilter: every match of the filtered rows is found, not only
    those among the best matches of the whole corpus."""
    stock = {r["sample_id"] for r in explorer_rows(explorer_corpus.root, "source = 'stock_photos'")
             if "astronaut" in (r["original_caption"] or "").lower()}
    assert stock
    found = all_ids(client, q="astronaut", source="stock_photos")
    assert stock <= set(found) and all(s.startswith("stock_photos/") for s in found)


# -- a corpus without the explorer's tables -----------------------------------------------------------

@pytest.fixture
def unexplored(small_corpus: Storage, tmp_path: Path) -> Path:
    """A copy of the small corpus as built before the `explorer` asset ran."""
    shutil.copytree(Path(small_corpus.root) / "lance", tmp_path / "lance")
    for table in ("explorer", "explorer_facets"):
        shutil.rmtree(tmp_path / "lance" / f"{table}.lance")
    return tmp_path


def test_a_corpus_without_the_explorer_tables_says_what_to_materialize(unexplored: Path) -> None:
    client = TestClient(create_app(Storage(str(unexplored))), base_url="http://localhost",
                        raise_server_exceptions=False)
    message = f"This corpus has no `explorer` and `explorer_facets` tables yet: {FIX}."
    for path in ("/", "/?q=cat&source=tiny", "/sample?id=tiny/001", "/overview", "/?like=tiny/001"):
        page = client.get(path)
        assert page.status_code == 200 and message in page.text, path
    body = search(client, q="cat")
    assert body["total"] == 0 and body["notes"] == [message]
    assert client.get("/api/neighbours", params={"like": "tiny/001"}).json()["note"] == message
    assert client.get("/healthz").json()["missing"] == message
    assert client.get("/thumb", params={"id": "tiny/001"}).status_code == 404
    assert client.get("/plot/resolution.png").status_code == 200  # "no data yet"


def test_a_missing_facets_table_is_named_alone(small_corpus: Storage, tmp_path: Path) -> None:
    shutil.copytree(Path(small_corpus.root) / "lance", tmp_path / "lance")
    shutil.rmtree(tmp_path / "lance" / "explorer_facets.lance")
    client = TestClient(create_app(Storage(str(tmp_path))), base_url="http://localhost")
    assert search(client)["notes"] == [f"This corpus has no `explorer_facets` table yet: {FIX}."]


# -- freshness ------------------------------------------------------------------------------------------

def test_a_refresh_picks_up_a_new_explorer_version(small_corpus: Storage, tmp_path: Path) -> None:
    shutil.copytree(Path(small_corpus.root) / "lance", tmp_path / "lance")
    client = TestClient(create_app(Storage(str(tmp_path)), ttl=0.0), base_url="http://localhost")
    assert search(client)["total"] == 40 and client.get("/sample", params={"id": "tiny/new"}).status_code == 404
    uri = Storage(str(tmp_path)).lance_uri("explorer")
    row = lance.dataset(uri).to_table(filter="sample_id = 'tiny/000'")
    row = row.set_column(row.schema.get_field_index("sample_id"), "sample_id", pa.array(["tiny/new"]))
    version = lance.dataset(uri).version
    lance.write_dataset(row, uri, mode="append")
    assert wait_for(lambda: search(client)["total"] == 41)
    assert client.get("/healthz").json()["versions"]["explorer"] > version
    page = client.get("/sample", params={"id": "tiny/new"})
    assert page.status_code == 200 and "the astronaut seen" in page.text


def test_a_refresh_keeps_the_caches_of_the_tables_it_reopens(small_corpus: Storage, tmp_path: Path) -> None:
    """Another table moving (a backfill of another stage) must not cost the explorer table its
    caches: its full-text index is seconds to load at 100M rows. A moved table is checked out
    from the dataset it replaces, so its cache carries over too."""
    shutil.copytree(Path(small_corpus.root) / "lance", tmp_path / "lance")
    storage = Storage(str(tmp_path))
    client = TestClient(create_app(storage, ttl=0.0), base_url="http://localhost")
    views = client.app.state.explorer.views
    assert search(client, q="astronaut")["total"] > 0
    first = views.get()
    lance.dataset(storage.lance_uri("samples")).delete("sample_id = 'tiny/039'")  # samples moves, explorer not
    assert wait_for(lambda: views.get().versions["samples"] > first.versions["samples"])
    second = views.get()
    assert second.table("explorer") is first.table("explorer")  # the same open dataset, caches and all
    lance.dataset(storage.lance_uri("explorer")).delete("sample_id = 'tiny/039'")
    assert wait_for(lambda: views.get().versions["explorer"] > second.versions["explorer"])
    assert search(client)["total"] == 39 and search(client, q="astronaut")["total"] > 0
