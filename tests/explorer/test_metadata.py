"""Source metadata and source URLs in the explorer: shown (escaped) on the detail page, a URL a
link only when http(s), the `meta=key:value` filter exact and combinable with the others and the
text search, the most common labels offered as a facet; over real Lance tables."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import lance
import pytest
from explorer_corpora import write_small_corpus
from markupsafe import escape
from starlette.testclient import TestClient

from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_explorer import query
from prx_explorer.app import create_app

LABELS = ("cat", "dog", "bird")
LONG = "x" * 300  # longer than the filter accepts: shown, never a facet or a filter link
HOSTILE_KEY, HOSTILE_VALUE = "<script>alert(1)</script>", '<img src=x onerror="alert(2)">'
HOSTILE_LABEL = '"><script>alert(5)</script>'
URLS = {0: "https://example.org/img/0.jpg", 4: "http://example.org/img/4.jpg?a=1&b=2", 1: "javascript:alert(1)",
        3: "ftp://example.org/x.jpg", 5: "data:text/html,<script>alert(4)</script>", 6: "https://exa mple.org/x.jpg"}
NOT_LINKS = (1, 3, 5, 6)


def source_metadata(i: int) -> tuple[dict[str, str] | None, str | None]:
    """Sample i's metadata map and source_url (rows 30 and 31 have none, as rows ingested before)."""
    if i in (30, 31):
        return None, None
    meta = {"label": LABELS[i % 3], "license": "cc-by" if i % 2 else "cc0", "width": "640"}
    meta |= {7: {HOSTILE_KEY: HOSTILE_VALUE}, 9: {"label": "cat & dog: mixed"}, 11: {"label": LONG},
             13: {"label": HOSTILE_LABEL}}.get(i, {})
    return meta, URLS.get(i)


class Page(HTMLParser):
    """Start tags with their attributes, and the text inside each <a>."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.links: list[tuple[dict[str, str | None], str]] = []
        self._open: list[dict[str, str | None]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "a":
            self._open.append(dict(attrs))
            self.links.append((dict(attrs), ""))

    def handle_data(self, data: str) -> None:
        if self._open:
            attrs, text = self.links[-1]
            self.links[-1] = (attrs, text + data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._open:
            self._open.pop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    return write_small_corpus(tmp_path_factory.mktemp("meta") / "corpus", metadata=source_metadata)


@pytest.fixture(scope="module")
def client(corpus: Storage) -> TestClient:
    return TestClient(create_app(corpus), base_url="http://localhost")


def matching(corpus: Storage, key: str, value: str) -> set[str]:
    """sample_ids whose metadata maps key to value, read from the table itself."""
    rows = lance_io.read_table(corpus.lance_uri("samples"), ["sample_id", "metadata"]).to_pylist()
    return {r["sample_id"] for r in rows if (key, value) in (r["metadata"] or [])}


def search_ids(client: TestClient, **params: str) -> set[str]:
    found = client.get("/api/search", params=params)
    assert found.status_code == 200, found.text
    body = found.json()
    assert body["pages"] == 1  # 40 rows: one page
    return {r["sample_id"] for r in body["rows"]}


def test_detail_page_shows_the_metadata_and_the_source_url(client: TestClient) -> None:
    page = client.get("/sample", params={"id": "tiny/004"}).text
    for key, value in (("label", "dog"), ("license", "cc0"), ("width", "640")):
        assert f"<tr><th>{key}</th><td>" in page
        assert ({"href": f"/?meta={key}%3A{value}"}, value) in Page(page).links
    [(attrs, text)] = [(a, t) for a, t in Page(page).links if a.get("href") == URLS[4]]
    assert attrs["rel"] == "noopener noreferrer nofollow" and text == URLS[4]
    empty = client.get("/sample", params={"id": "tiny/030"}).text  # a row without metadata
    assert '<p id="metadata"><em>none</em></p>' in empty and '<td id="source-url">none</td>' in empty


@pytest.mark.parametrize("i", NOT_LINKS)
def test_a_source_url_other_than_http_is_text_never_a_link(client: TestClient, i: int) -> None:
    page = client.get("/sample", params={"id": f"tiny/{i:03d}"}).text
    parsed = Page(page)
    assert not [a for a, _ in parsed.links if (a.get("href") or "") == URLS[i]]
    hrefs = [(a.get("href") or "").strip().lower() for a, _ in parsed.links]
    assert not [h for h in hrefs if h.startswith(("javascript:", "data:", "ftp:"))]
    assert f'<td id="source-url"><code>{escape(URLS[i])}</code></td>' in page
    assert not [t for t, _ in parsed.tags if t == "script"]


def test_hostile_metadata_renders_inert(client: TestClient) -> None:
    pages = [client.get("/sample", params={"id": sample}).text for sample in ("tiny/007", "tiny/013")]
    pages += [client.get("/").text, client.get("/", params={"meta": f"label:{HOSTILE_LABEL}"}).text]  # the menus
    assert escape(HOSTILE_KEY) in pages[0] and escape(HOSTILE_VALUE) in pages[0]
    assert escape(HOSTILE_LABEL) in pages[1] and escape(HOSTILE_LABEL) in pages[2]  # the facet option
    for page in pages:
        tags = Page(page).tags
        assert not [t for t, _ in tags if t == "script"]
        assert not [(t, a) for t, a in tags if any(k.startswith("on") for k in a)]
        assert not [a for t, a in tags if t == "img" and a.get("src") == "x"]
    assert search_ids(client, meta=f"label:{HOSTILE_LABEL}") == {"tiny/013"}  # and filtered like any value


@pytest.mark.parametrize("key,value", [("label", "cat"), ("label", "dog"), ("license", "cc-by"), ("width", "640"),
                                       ("label", "cat & dog: mixed"), (HOSTILE_KEY, HOSTILE_VALUE),
                                       ("label", "lion"), ("nokey", "cat")])
def test_the_meta_filter_returns_exactly_the_matching_samples(client: TestClient, corpus: Storage, key: str,
                                                              value: str) -> None:
    want = matching(corpus, key, value)
    assert search_ids(client, meta=f"{key}:{value}") == want
    assert bool(want) == (value not in ("lion",) and key != "nokey")


def test_the_meta_filter_combines_with_filters_and_text_search(client: TestClient, corpus: Storage) -> None:
    cats = matching(corpus, "label", "cat")
    astronauts = {f"tiny/{i:03d}" for i in range(40) if i % 5 == 0}  # "a astronaut photo", "the astronaut seen"
    both = search_ids(client, q="astronaut", meta="label:cat")
    assert both == cats & astronauts and both
    group = {f"tiny/{i:03d}" for i in range(5)}
    assert search_ids(client, group="00000000000000ab", meta="label:dog") == group & matching(corpus, "label", "dog")
    assert search_ids(client, meta=" label : cat ") == cats  # normalised, as the menu writes it


def test_a_metadata_link_on_the_detail_page_filters_to_that_value(client: TestClient, corpus: Storage) -> None:
    page = Page(client.get("/sample", params={"id": "tiny/009"}).text)
    [(attrs, _)] = [(a, t) for a, t in page.links if t == "cat & dog: mixed"]
    assert attrs["href"].startswith("/?meta=")
    listed = client.get("/api/search" + attrs["href"][1:]).json()  # the same query as JSON
    assert [r["sample_id"] for r in listed["rows"]] == ["tiny/009"] and listed["total"] == 1
    assert client.get(attrs["href"]).status_code == 200
    assert not [a for a, t in page.links if t == LONG]  # too long to filter on: shown without a link


def test_the_most_common_labels_are_offered_with_their_counts(client: TestClient, corpus: Storage) -> None:
    facets = dict(client.get("/api/search").json()["facets"]["meta"])
    rows = lance_io.read_table(corpus.lance_uri("samples"), ["metadata"]).to_pylist()
    labels = [dict(r["metadata"])["label"] for r in rows if r["metadata"]]
    want = {f"label:{v}": labels.count(v) for v in set(labels) if v != LONG}
    assert facets == want and facets["label:cat"] > 1
    page = client.get("/", params={"meta": "label:dog"}).text
    assert f'<option value="label:dog" selected>label:dog ({labels.count("dog")})</option>' in page
    narrowed = dict(client.get("/api/search", params={"meta": "license:cc-by"}).json()["facets"]["meta"])
    assert sum(narrowed.values()) == len(matching(corpus, "license", "cc-by") - {"tiny/011"})  # of the filtered rows


@pytest.mark.parametrize("value", ["nocolon", ":cat", " : cat", "k" * 65 + ":v", "label:" + "v" * 201, "a\x00:b",
                                   "label:" + "v" * 600])
def test_a_malformed_meta_filter_is_a_400_naming_it(client: TestClient, value: str) -> None:
    for route in ("/", "/api/search"):
        response = client.get(route, params={"meta": value})
        assert response.status_code == 400 and "meta" in response.text, (route, value)


@pytest.mark.parametrize("value", ["label:cat' OR '1'='1", "label') OR true --:x", "x'):cat"])
def test_meta_values_are_literals_never_sql(client: TestClient, value: str) -> None:
    assert search_ids(client, meta=value) == set()


def test_a_table_without_metadata_columns_shows_none_and_matches_nothing(tmp_path: Path) -> None:
    storage = write_small_corpus(tmp_path / "corpus", n=8)
    uri = storage.lance_uri("samples")
    lance_io.overwrite(uri, lance_io.read_table(uri).drop_columns(["metadata", "source_url"]))  # an older table
    old = TestClient(create_app(storage), base_url="http://localhost")
    body = old.get("/api/search", params={"meta": "label:cat"}).json()
    assert body["total"] == 0 and body["notes"] == ["this corpus's samples carry no metadata"]
    assert old.get("/api/search").json()["facets"]["meta"] == []
    page = old.get("/sample", params={"id": "tiny/001"}).text
    assert '<td id="source-url">none</td>' in page and '<p id="metadata"><em>none</em></p>' in page


def test_a_meta_filter_reads_a_bounded_number_of_rows_and_says_so(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A key other than `label` has no index: the scan stops after META_SCAN_ROWS rows (whole
    fragments) and the page says the answer covers only them."""
    storage = write_small_corpus(tmp_path / "corpus", metadata=source_metadata)
    uri = storage.lance_uri("samples")
    lance.write_dataset(lance_io.read_table(uri), uri, mode="overwrite", max_rows_per_file=10)  # 4 fragments
    client = TestClient(create_app(storage), base_url="http://localhost")
    everywhere = matching(storage, "license", "cc-by")
    monkeypatch.setattr(query, "META_SCAN_ROWS", 20)
    body = client.get("/api/search", params={"meta": "license:cc-by"}).json()
    first = {f"tiny/{i:03d}" for i in range(20)}
    assert {r["sample_id"] for r in body["rows"]} == everywhere & first != everywhere
    assert body["notes"] == ["the metadata filter searched the first 20 samples only (it has no index): "
                             "narrow it with a source, or use the label key"]
    monkeypatch.setattr(query, "META_SCAN_ROWS", 40)
    client = TestClient(create_app(storage), base_url="http://localhost")  # a new app: the last answer is cached
    body = client.get("/api/search", params={"meta": "license:cc-by"}).json()
    assert {r["sample_id"] for r in body["rows"]} == everywhere and body["notes"] == []
