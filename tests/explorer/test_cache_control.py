"""No page or JSON answer of the explorer may be kept by a browser or a proxy: every HTML and JSON
response, errors included, carries `Cache-Control: no-store`; thumbnails of stored images (bytes
of one content, fixed) keep their private caching, the stylesheet and plots theirs."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.testclient import TestClient

from loopback import fetch, serve
from prx_core.store.storage import Storage
from prx_explorer.app import create_app

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus


def paths(corpus: ExplorerCorpus) -> dict[str, tuple[int, str]]:
    """path -> (status, content type) of every kind of HTML and JSON answer."""
    photo = next(e["sample_id"] for e in corpus.manifest if e["kinds"] == ["photo"])
    return {
        "/": (200, "text/html"), "/?q=astronaut": (200, "text/html"), "/?q=%22ice%20cold%22": (200, "text/html"),
        f"/sample?id={quote(photo)}": (200, "text/html"), "/sample?id=nope/none": (404, "text/html"),
        "/overview": (200, "text/html"), "/?page=%C2%B2": (400, "text/html"),
        "/api/search": (200, "application/json"), f"/api/neighbours?like={quote(photo)}": (200, "application/json"),
        "/healthz": (200, "application/json"), "/api/search?page=0": (400, "application/json"),
        "/thumb?id=nope/none": (404, "text/plain"), "/no-such-route": (404, "text/plain"),
    }


def test_every_page_and_json_answer_is_no_store(client: TestClient, explorer_corpus: ExplorerCorpus) -> None:
    for path, (status, kind) in paths(explorer_corpus).items():
        response = client.get(path)
        assert (response.status_code, response.headers["content-type"].split(";")[0]) == (status, kind), path
        assert response.headers["cache-control"] == "no-store", path


def test_cache_control_over_http(explorer_corpus: ExplorerCorpus) -> None:
    """The same through a real server on loopback, with the caching that other answers keep."""
    photo = next(e["sample_id"] for e in explorer_corpus.manifest if e["kinds"] == ["photo"])
    with serve(create_app(Storage(str(explorer_corpus.root)))) as port:
        for path, (status, _) in paths(explorer_corpus).items():
            answer = fetch(port, path)
            assert (answer.status, answer.headers["cache-control"]) == (status, "no-store"), path
        thumbnail = fetch(port, f"/thumb?id={quote(photo)}&size=256")
        assert thumbnail.status == 200 and thumbnail.headers["cache-control"] == "private, max-age=3600"
        assert fetch(port, "/style.css").headers["cache-control"] == "max-age=3600"
        assert fetch(port, "/plot/resolution.png").headers["cache-control"] == "no-cache"
