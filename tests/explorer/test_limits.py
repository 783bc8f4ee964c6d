"""What one request may cost: a duplicate group of thousands renders one page of members with
the group's count, and nearest neighbours are computed once per corpus version and query."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from explorer_corpora import write_explorer
from starlette.testclient import TestClient

from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage
from prx_explorer import query, search
from prx_explorer.app import create_app
from prx_explorer.scans import RETRY_AFTER, ScanSlots

MEMBERS = 3000
GROUP = "00000000deadbeef"


@pytest.fixture(scope="module")
def big_group(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    """A corpus whose 3,000 samples are one duplicate group, in real Lance tables; the keeper is
    the last sample_id, so it shows first only if the page puts keepers first."""
    root = tmp_path_factory.mktemp("group") / "corpus"
    storage = Storage(str(root))
    ids = [f"web/{i:05d}" for i in range(MEMBERS)]
    samples = [{"sample_id": s, "content_id": f"c{s}", "source": "web", "source_key": s[4:], "width": 640,
                "height": 480} for s in ids]
    duplicates = [{"sample_id": s, "source": "web", "group_id": GROUP, "group_size": MEMBERS, "keeper": s == ids[-1],
                   "keeper_sample_id": ids[-1], "pixels": 640 * 480} for s in ids]
    lance_io.overwrite(storage.lance_uri("samples"), pa.Table.from_pylist(samples, schema=schemas.SAMPLES))
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.Table.from_pylist(duplicates, schema=schemas.DUPLICATES))
    write_explorer(storage)
    return TestClient(create_app(storage), base_url="http://localhost")


def members(html: str) -> list[str]:
    """The sample ids of the group's member cards, in page order."""
    section = html.split('<section class="group"', 1)[1]
    return re.findall(r'<a class="sid" href="/sample\?id=([^"]+)">', section)


def test_a_huge_duplicate_group_renders_one_page_of_members_with_its_count(big_group: TestClient) -> None:
    html = big_group.get("/sample", params={"id": "web/01234"}).text
    first = members(html)
    assert len(first) == 100, len(first)
    assert first[0] == "web/02999", "the keeper leads the first page"
    assert f"{MEMBERS} images" in html and "members 1–100" in html
    assert f'href="/?group={GROUP}"' in html  # every member, paged, in search
    assert "group_page=2" in html and "group_page=0" not in html
    seen = list(first)
    for page in range(2, MEMBERS // 100 + 1):
        seen += members(big_group.get("/sample", params={"id": "web/01234", "group_page": str(page)}).text)
    assert len(seen) == len(set(seen)) == MEMBERS
    last = big_group.get("/sample", params={"id": "web/01234", "group_page": "30"}).text
    assert "group_page=31" not in last and "group_page=29" in last
    beyond = big_group.get("/sample", params={"id": "web/01234", "group_page": "31"})
    assert beyond.status_code == 200 and members(beyond.text) == []


# -- paging depth and concurrent scans -------------------------------------------------------------------

def test_paging_stops_at_max_page_and_says_how_to_see_the_rest(big_group: TestClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query, "MAX_PAGE", 10)  # 480 rows paged of the 3,000
    monkeypatch.setattr(search, "MAX_PAGE", 10)
    body = big_group.get("/api/search", params={"page": "10"}).json()
    assert (body["total"], body["pages"], len(body["rows"])) == (MEMBERS, 10, search.PAGE_SIZE)
    assert body["notes"] == [f"{MEMBERS:,} matches: the first 480 are paged (a page's cost grows with its depth); "
                             "narrow the search with a filter to see the others"]
    beyond = big_group.get("/api/search", params={"page": "11"})
    assert beyond.status_code == 400 and beyond.json() == {"error": "query parameter 'page': must be from 1 to 10"}
    html = big_group.get("/", params={"page": "10"}).text
    assert "page 10 / 10" in html and 'rel="next"' not in html and "narrow the search with a filter" in html


def test_requests_beyond_the_scan_slots_are_refused_with_retry_after(big_group: TestClient) -> None:
    explorer = big_group.app.state.explorer
    default = explorer.scans
    explorer.scans = ScanSlots(slots=1, wait_s=0.2)
    try:
        with explorer.scans.slot():  # the one slot held, as by a long search
            refused = [big_group.get("/api/search", params={"q": "photo"}), big_group.get("/"),
                       big_group.get("/api/neighbours", params={"like": "web/00001"}),
                       big_group.get("/sample", params={"id": "web/00001"})]
        assert [r.status_code for r in refused] == [503] * 4
        assert all(r.headers["retry-after"] == RETRY_AFTER and r.headers["cache-control"] == "no-store" for r in refused)
        assert "busy" in refused[0].json()["error"] and "busy" in refused[1].text
        assert big_group.get("/api/search", params={"q": "photo"}).status_code == 200  # the slot free again
        assert big_group.get("/healthz").json()["scans"] == {"slots": 1, "running": 0, "refused": 4}
    finally:
        explorer.scans = default


# -- the nearest-neighbour cache -----------------------------------------------------------------------

@pytest.fixture
def counted(small_corpus: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, list]:
    """An explorer over a copy of the corpus (re-checked at every request) whose nearest-neighbour
    computation, the real one, records each call."""
    from prx_explorer import app as app_module
    from prx_explorer import search as search_module

    shutil.copytree(Path(small_corpus.root) / "lance", tmp_path / "lance")
    calls: list[tuple[str, str]] = []
    real = search_module.neighbours

    def neighbours(view, sample_id: str, by: str):
        calls.append((sample_id, by))
        return real(view, sample_id, by)

    monkeypatch.setattr(search_module, "neighbours", neighbours)
    monkeypatch.setattr(app_module, "neighbours", neighbours, raising=False)  # where the uncached route called it
    return TestClient(create_app(Storage(str(tmp_path)), ttl=0.0), base_url="http://localhost"), calls


def test_neighbours_are_cached_per_table_versions_and_query(counted: tuple[TestClient, list], tmp_path: Path) -> None:
    client, calls = counted
    like = "tiny/007"
    first = client.get("/api/neighbours", params={"like": like, "by": "caption"}).json()
    assert first["neighbours"] and len(calls) == 1
    assert client.get("/api/neighbours", params={"like": like, "by": "caption"}).json() == first
    assert len(calls) == 1, "the second identical request did not re-query"
    assert client.get("/", params={"like": like}).status_code == 200  # the search page shares the cache
    assert len(calls) == 1
    client.get("/api/neighbours", params={"like": like, "by": "clip"})
    assert calls == [(like, "caption"), (like, "clip")]

    uri = Storage(str(tmp_path)).lance_uri("caption_embeddings")
    version = lance.dataset(uri).version
    lance.dataset(uri).delete("content_id = 'not-a-content-id'")  # a new version, same rows
    assert lance.dataset(uri).version > version
    deadline = time.monotonic() + 60
    while client.get("/healthz").json()["versions"]["caption_embeddings"] <= version:
        assert time.monotonic() < deadline, "the view never saw the new version"
        time.sleep(0.05)
    assert client.get("/api/neighbours", params={"like": like, "by": "caption"}).json() == first
    assert calls[-1] == (like, "caption") and len(calls) == 3, "a new table version invalidates the cache"


def test_the_neighbour_cache_is_bounded(counted: tuple[TestClient, list]) -> None:
    client, calls = counted
    cache = client.app.state.explorer.nearest
    cache.size = 3
    ids = [f"tiny/{i:03d}" for i in range(5)]
    for sample_id in ids:
        client.get("/api/neighbours", params={"like": sample_id})
    assert len(cache) == 3 and len(calls) == 5
    client.get("/api/neighbours", params={"like": ids[-1]})  # still cached
    client.get("/api/neighbours", params={"like": ids[0]})  # evicted: computed again
    assert len(calls) == 6
