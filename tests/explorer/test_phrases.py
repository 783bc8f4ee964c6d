"""Quoted phrases in the search box, over the pipeline-built corpus (whose full-text indexes have
no token positions): a phrase finds the captions holding its words in order and adjacent, and a
failing search says so in a fixed sentence, never with the exception's text or a path."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import pytest
from explorer_corpora import write_small_corpus
from starlette.testclient import TestClient

from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_explorer import search as search_module
from prx_explorer import view as view_module
from prx_explorer.app import SERVER_ERROR, create_app
from prx_explorer.fulltext import holds_phrases, parse_text

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus

LEAKS = ("scanner.rs", "position is not found", ".lance", "Traceback", "/secret")


def ids(client: TestClient, q: str) -> list[dict]:
    """Every row of a search (all pages), checking the answer carries no note."""
    rows, page = [], 1
    while True:
        body = client.get("/api/search", params={"q": q, "page": str(page)}).json()
        assert body["notes"] == [], body["notes"]
        rows += body["rows"]
        if page >= body["pages"]:
            return rows
        page += 1


def adjacent(text: str, phrase: str) -> bool:
    """`phrase` as consecutive words of `text`, plainly (lower case, no stemming)."""
    words, wanted = re.findall(r"\w+", text.lower()), phrase.split()
    return any(words[i:i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1))


def text_of(row: dict) -> str:
    return f"{row['caption'] or ''} . {row['original_caption'] or ''}"


def test_a_quoted_phrase_finds_exactly_the_captions_holding_it(client: TestClient,
                                                               explorer_corpus: ExplorerCorpus) -> None:
    page = client.get("/", params={"q": '"ice cold"'})
    assert page.status_code == 200
    assert 'class="note"' not in page.text and not [s for s in LEAKS if s in page.text]
    samples = lance_io.read_table(Storage(str(explorer_corpus.root)).lance_uri("samples"),
                                  ["sample_id", "original_caption"]).to_pylist()
    holding = {r["sample_id"] for r in samples if adjacent(r["original_caption"] or "", "ice cold")}
    assert len(holding) >= 5
    found = ids(client, '"ice cold"')
    assert holding <= {r["sample_id"] for r in found}, "every original caption saying 'ice cold' is found"
    assert all(adjacent(text_of(r), "ice cold") for r in found), "and only captions saying it"
    assert "<mark>Ice</mark> <mark>Cold</mark>" in page.text
    words = ids(client, "ice cold")  # unquoted: either word (e.g. 'Cold Ripple'), as before
    assert {r["sample_id"] for r in found} < {r["sample_id"] for r in words}


def test_the_words_of_a_phrase_out_of_order_do_not_match(client: TestClient) -> None:
    reversed_ = ids(client, '"cold ice"')
    assert all(adjacent(text_of(r), "cold ice") for r in reversed_)
    assert not {r["sample_id"] for r in reversed_} & {r["sample_id"] for r in ids(client, '"ice cold"')
                                                      if not adjacent(text_of(r), "cold ice")}
    apart = ids(client, '"wallpaper desktop"')  # both words in hundreds of captions, never in this order
    assert apart == []
    assert ids(client, '"desktop wallpaper"')


def test_a_phrase_combines_with_words_and_filters(client: TestClient) -> None:
    both = ids(client, '"ice cold" close')  # with a phrase, every word is required
    assert both and all(adjacent(text_of(r), "ice cold") and "close" in text_of(r).lower() for r in both)
    web = [r["sample_id"] for r in client.get("/api/search", params={"q": '"ice cold"', "source": "web_images"})
           .json()["rows"]]
    assert web and all(s.startswith("web_images/") for s in web)


@pytest.mark.parametrize("text, words, phrases", [
    ('"red car"', "red car", (("red", "car"),)),
    ('a "Running dogs" b', "a  Running dogs  b", (("run", "dog"),)),
    ('"unclosed', "unclosed", ()),
    ('"cat"', "cat", ()),  # a one-word phrase is a word
    ('""', "", ()),
])
def test_parse_text(text: str, words: str, phrases: tuple) -> None:
    parsed = parse_text(text)
    assert (parsed.words, parsed.phrases) == (words, phrases)


def test_holds_phrases_needs_order_and_adjacency() -> None:
    phrases = parse_text('"red car" "blue sky"').phrases
    assert holds_phrases("A red car under a Blue Sky.", phrases)
    assert not holds_phrases("A red car under a sky, blue.", phrases)
    assert not holds_phrases("A red bus and a car under a blue sky", phrases)
    assert not holds_phrases(None, phrases)


# -- failures say so in fixed words ---------------------------------------------------------------

@pytest.fixture
def fresh(small_corpus: Storage) -> TestClient:
    return TestClient(create_app(small_corpus), base_url="http://localhost")


def test_a_failing_search_shows_a_fixed_note_and_logs_the_details(fresh: TestClient, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def failing(view, text: str, where: str | None = None):
        raise ValueError("Invalid user input: /secret/corpus/lance/captions.lance/_indices/1: position is not found, "
                         "/home/runner/work/lance/lance/rust/lance/src/dataset/scanner.rs:5939:32")

    monkeypatch.setattr(search_module, "text_hits", failing)
    with caplog.at_level(logging.ERROR, logger="prx_explorer.search"):
        page = fresh.get("/", params={"q": "cat"})
        body = fresh.get("/api/search", params={"q": "river"}).json()
    assert page.status_code == 200 and search_module.SEARCH_FAILED in page.text
    assert body["notes"] == [search_module.SEARCH_FAILED] and body["total"] == 0
    assert not [s for s in LEAKS if s in page.text or s in str(body)]
    assert "scanner.rs" in caplog.text and "/secret/corpus" in caplog.text  # the details are in the server's log


def test_a_failure_in_a_request_is_a_fixed_500_with_the_headers(small_corpus: Storage, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def broken(storage: Storage, previous: object = None):
        raise OSError("/secret/corpus/lance/samples.lance/_versions/7.manifest: object store unreachable")

    monkeypatch.setattr(view_module, "open_view", broken)  # the first open runs in the request
    client = TestClient(create_app(small_corpus), base_url="http://localhost")
    with caplog.at_level(logging.ERROR, logger="prx_explorer.app"):
        for path in ("/", "/api/search", "/sample?id=tiny/001", "/healthz"):
            response = client.get(path)
            assert response.status_code == 500 and response.text == SERVER_ERROR, (path, response.text)
            assert response.headers["cache-control"] == "no-store"
            assert response.headers["content-security-policy"].startswith("default-src 'none'")
    assert "unreachable" in caplog.text


def test_a_failed_refresh_is_reported_without_its_text(small_corpus: Storage, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    import time

    import lance

    shutil.copytree(f"{small_corpus.root}/lance", tmp_path / "lance")
    client = TestClient(create_app(Storage(str(tmp_path)), ttl=0.0), base_url="http://localhost")
    assert client.get("/healthz").json()["refresh_error"] is None

    def broken(storage: Storage, previous: object = None):
        raise OSError("/secret/corpus/lance/samples.lance: object store unreachable")

    monkeypatch.setattr(view_module, "open_view", broken)
    lance.dataset(Storage(str(tmp_path)).lance_uri("samples")).delete("sample_id = 'tiny/000'")  # a new version
    deadline = time.monotonic() + 60
    while (error := client.get("/healthz").json()["refresh_error"]) is None:
        assert time.monotonic() < deadline, "the failed refresh was never reported"
        time.sleep(0.05)
    assert "OSError" in error and "/secret" not in error and "unreachable" not in error


def test_an_explorer_table_without_its_search_column_says_to_rematerialize(tmp_path) -> None:
    """A corpus whose `explorer` rows were written before `search_text` existed: the search names the fix."""
    storage = write_small_corpus(tmp_path / "corpus")
    uri = storage.lance_uri("explorer")
    lance_io.overwrite(uri, lance_io.read_table(uri).drop_columns(["search_text"]))
    client = TestClient(create_app(storage), base_url="http://localhost")
    body = client.get("/api/search", params={"q": "river"}).json()
    assert body["notes"] == [search_module.NO_SEARCH_TEXT] and body["total"] == 0
    assert client.get("/api/search", params={}).json()["total"] == 40  # browsing still works
