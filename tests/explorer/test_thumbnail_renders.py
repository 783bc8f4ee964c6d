"""Thumbnail renders over real HTTP (uvicorn on loopback, requests from real threads): concurrent
requests for one image share one render, renders are bounded with the overflow refused as a 503,
and an image past the thumbnail decode budget is a placeholder that is not rendered again.

Renders are counted by wrapping the real `make_thumbnail`; a gate holds them open so that what
overlaps is decided by the test, not by timing. Assertions are on counts, never on durations."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote

import pandas as pd
import pytest
from PIL import Image

from loopback import Answer, fetch, serve, wait_for
from prx_core.image.budget import DEFAULT_DECODE_SECONDS
from prx_core.store.storage import Storage
from prx_explorer import render, scans, thumbnails
from prx_explorer.app import create_app
from prx_explorer.thumbnails import ThumbnailRenders

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus


@dataclass
class Gate:
    """The real renderer, counted; each render waits for `open` before it runs."""

    open: threading.Event = field(default_factory=threading.Event)
    calls: list[int] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, real):
        def counted(data: bytes, size: int, budget_s: float | None = None) -> bytes | None:
            with self.lock:
                self.calls.append(size)
                self.active += 1
                self.peak = max(self.peak, self.active)
            try:
                assert self.open.wait(120), "the test never opened the gate"
                return real(data, size, budget_s)
            finally:
                with self.lock:
                    self.active -= 1
        return counted


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    gate = Gate()
    monkeypatch.setattr(thumbnails, "make_thumbnail", gate.wrap(render.make_thumbnail))
    return gate


@pytest.fixture
def app(explorer_corpus: ExplorerCorpus):
    app = create_app(Storage(str(explorer_corpus.root)))
    app.state.explorer.views.get()  # the first open of the tables, before any request is timed by a gate
    return app


@pytest.fixture
def port(app) -> Iterator[int]:
    with serve(app) as port:
        yield port


def stored(app) -> pd.DataFrame:
    """Samples with stored image bytes (the explorer's rows of them), in a stable order."""
    explorer = app.state.explorer.views.get().table("explorer")
    return explorer.to_table(columns=["sample_id", "content_id"], filter="stored").to_pandas().sort_values("sample_id")


def thumb(sample_id: str, size: int = 256) -> str:
    return f"/thumb?id={quote(sample_id)}&size={size}"


def test_concurrent_requests_for_one_thumbnail_render_it_once(app, port: int, gate: Gate) -> None:
    frame = stored(app)
    shared = frame.groupby("content_id", observed=True)["sample_id"].agg(list)
    copies = next(ids for ids in shared if len(ids) >= 2)  # byte copies under two sample ids share one content
    renders = app.state.explorer.renders
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(fetch, port, thumb(copies[i % 2])) for i in range(8)]
        # all eight are in, and the leader's render began (after its lookup of the bytes): seven wait for it
        wait_for(lambda: renders.pending == 8 and len(gate.calls) >= 1)
        assert len(gate.calls) == 1
        gate.open.set()
        answers = [f.result() for f in futures]
    assert [a.status for a in answers] == [200] * 8
    assert len({a.body for a in answers}) == 1 and Image.open(io.BytesIO(answers[0].body)).format == "JPEG"
    assert len(gate.calls) == 1, "eight concurrent requests for one thumbnail rendered it once"
    assert fetch(port, thumb(copies[0])).body == answers[0].body and len(gate.calls) == 1  # then from the cache
    assert renders.stats()["pending"] == 0


def test_renders_are_bounded_and_the_overflow_is_refused_with_retry_after(app, port: int, gate: Gate) -> None:
    explorer = app.state.explorer
    explorer.renders = ThumbnailRenders(explorer.thumbs, renders=2, queue=3)
    ids = stored(app).drop_duplicates("content_id")["sample_id"].tolist()[:10]
    assert len(ids) == 10
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(fetch, port, thumb(sample_id)) for sample_id in ids]
        wait_for(lambda: sum(f.done() for f in futures) == 5)  # beyond 2 rendering + 3 queued: refused at once
        wait_for(lambda: len(gate.calls) == 2)
        assert explorer.renders.pending == 5 and gate.active == 2
        gate.open.set()
        answers: list[Answer] = [f.result() for f in futures]
    ok = [a for a in answers if a.status == 200]
    busy = [a for a in answers if a.status == 503]
    assert len(ok) == 5 and len(busy) == 5, [a.status for a in answers]
    assert all(a.headers["retry-after"] == scans.RETRY_AFTER and a.headers["cache-control"] == "no-store"
               for a in busy)
    assert all(a.headers["x-thumbnail"] == "busy" and Image.open(io.BytesIO(a.body)).format == "JPEG"
               for a in busy)  # an image a browser shows, not a broken one
    assert all(Image.open(io.BytesIO(a.body)).format == "JPEG" for a in ok)
    assert len(gate.calls) == 5 and gate.peak == 2, "never more than two renders at a time"
    assert explorer.renders.stats()["busy"] == 5
    refused = [sample_id for sample_id, a in zip(ids, answers) if a.status == 503]
    assert fetch(port, thumb(refused[0])).status == 200  # a refused request succeeds once there is room


def test_an_image_past_the_thumbnail_budget_is_a_placeholder_rendered_once(app, port: int, gate: Gate,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert render.THUMB_DECODE_SECONDS < DEFAULT_DECODE_SECONDS  # a page waits on it: shorter than a stage's
    monkeypatch.setattr(render, "THUMB_DECODE_SECONDS", 0.0)  # every real decode now spends its budget
    gate.open.set()
    sample_id = stored(app)["sample_id"].iloc[0]
    first, second = fetch(port, thumb(sample_id, 768)), fetch(port, thumb(sample_id, 768))
    for answer in (first, second):
        assert answer.status == 200 and answer.headers["x-thumbnail"] == "placeholder"
        assert answer.headers["content-type"] == "image/jpeg" and answer.headers["cache-control"] == "no-store"
        assert Image.open(io.BytesIO(answer.body)).size == (768, 576)
    assert gate.calls == [768], "a refused image is remembered, not decoded on every visit"
    page = fetch(port, f"/sample?id={quote(sample_id)}")
    assert page.status == 200 and f"/thumb?id={quote(sample_id)}".encode() in page.body
    assert b"decode_timeout" not in page.body and b"budget" not in page.body


def test_a_failed_render_is_not_remembered(app, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def broken(data: bytes, size: int, budget_s: float | None = None) -> bytes | None:
        calls.append(size)
        raise RuntimeError("/secret/corpus/lance/samples.lance: injected failure")

    monkeypatch.setattr(thumbnails, "make_thumbnail", broken)
    sample_id = stored(app)["sample_id"].iloc[1]
    for expected in (1, 2):
        answer = fetch(port, thumb(sample_id))
        assert answer.status == 500 and b"/secret" not in answer.body and b"injected" not in answer.body
        assert answer.headers["cache-control"] == "no-store"
        assert len(calls) == expected and app.state.explorer.renders.pending == 0
    monkeypatch.undo()
    assert fetch(port, thumb(sample_id)).status == 200
