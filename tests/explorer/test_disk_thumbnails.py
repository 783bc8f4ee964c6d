"""The thumbnails' disk cache: a restarted explorer serves what an earlier one rendered without
decoding again (a refused image included), the folder stays under its bound by dropping the least
recently used files, and a broken folder only costs renders, never a request."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from PIL import Image
from starlette.testclient import TestClient

from prx_core.store.storage import Storage
from prx_explorer import render, thumbnails
from prx_explorer.app import create_app
from prx_explorer.disk_cache import DiskThumbnails
from prx_explorer.render import ThumbnailCache

if TYPE_CHECKING:
    from explorer_corpora import ExplorerCorpus


def counted_renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def counted(data: bytes, size: int, budget_s: float | None = None) -> bytes | None:
        calls.append(size)
        return real(data, size, budget_s)

    real = render.make_thumbnail
    monkeypatch.setattr(thumbnails, "make_thumbnail", counted)
    return calls


def client(corpus: ExplorerCorpus, folder: Path) -> TestClient:
    return TestClient(create_app(Storage(str(corpus.root)), thumbnails=DiskThumbnails(folder)), base_url="http://localhost")


def test_a_restarted_explorer_serves_earlier_renders_from_disk(explorer_corpus: ExplorerCorpus, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_renders(monkeypatch)
    first = client(explorer_corpus, tmp_path / "thumbs")
    rows = first.app.state.explorer.views.get().table("explorer").to_table(
        columns=["sample_id"], filter="stored", limit=2)["sample_id"].to_pylist()
    answers = [first.get("/thumb", params={"id": s, "size": 256}) for s in rows]
    assert [a.status_code for a in answers] == [200, 200] and len(calls) == 2
    assert Image.open(io.BytesIO(answers[0].content)).format == "JPEG"

    again = client(explorer_corpus, tmp_path / "thumbs")  # a new process's caches: empty memory, same folder
    assert [again.get("/thumb", params={"id": s, "size": 256}).content for s in rows] == [a.content for a in answers]
    assert len(calls) == 2, "served from disk, not rendered again"
    assert again.app.state.explorer.thumbs.disk_hits == 2
    assert again.get("/thumb", params={"id": rows[0], "size": 768}).status_code == 200 and len(calls) == 3  # a new size


def test_a_refused_image_is_remembered_on_disk(explorer_corpus: ExplorerCorpus, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_renders(monkeypatch)
    monkeypatch.setattr(render, "THUMB_DECODE_SECONDS", 0.0)  # every decode spends its budget: refused
    first = client(explorer_corpus, tmp_path / "thumbs")
    sample_id = first.app.state.explorer.views.get().table("explorer").to_table(
        columns=["sample_id"], filter="stored", limit=1)["sample_id"][0].as_py()
    assert first.get("/thumb", params={"id": sample_id, "size": 768}).headers["x-thumbnail"] == "placeholder"
    again = client(explorer_corpus, tmp_path / "thumbs")
    assert again.get("/thumb", params={"id": sample_id, "size": 768}).headers["x-thumbnail"] == "placeholder"
    assert len(calls) == 1


def test_the_folder_stays_under_its_bound_least_recently_used_first(tmp_path: Path) -> None:
    disk = DiskThumbnails(tmp_path, max_bytes=10_000)
    for i in range(8):
        disk.put((f"c{i}", 256), bytes(1_000))
        os.utime(disk.path((f"c{i}", 256)), (1_000 + i, 1_000 + i))  # written in order, a second apart
    assert disk.get(("c0", 256)) == bytes(1_000)  # used again: now the most recent
    for i in range(8, 12):
        disk.put((f"c{i}", 256), bytes(1_000))
    kept = {i for i in range(12) if disk.path((f"c{i}", 256)).exists()}
    assert disk.bytes == 1_000 * len(kept) <= 10_000
    assert 0 in kept and 1 not in kept and {9, 10, 11} <= kept, kept
    assert DiskThumbnails(tmp_path, max_bytes=10_000).bytes == disk.bytes  # counted again on open


def test_a_broken_folder_costs_renders_not_requests(tmp_path: Path) -> None:
    disk = DiskThumbnails(tmp_path / "thumbs")
    cache = ThumbnailCache(disk=disk)
    (tmp_path / "thumbs").chmod(0o500)  # no writes
    try:
        cache.put(("c", 256), b"jpeg")
        assert cache.get(("c", 256)) == b"jpeg"  # memory still serves it
        if os.geteuid() != 0:  # root writes anyway: then the file is simply there
            assert disk.get(("c", 256)) is None
    finally:
        (tmp_path / "thumbs").chmod(0o700)
