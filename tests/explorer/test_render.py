"""Pure helpers of the explorer's pages: escaping with marked terms, snippets, crops, cache."""

from __future__ import annotations

import io

import pytest
from markupsafe import Markup
from PIL import Image

from prx_explorer.render import ThumbnailCache, crop_rect, highlight, make_thumbnail, query_terms, snippet


@pytest.mark.parametrize("text, terms, expected", [
    ("A red cat", {"cat"}, "A red <mark>cat</mark>"),
    ("Cats and CATS", query_terms("cat"), "<mark>Cats</mark> and <mark>CATS</mark>"),
    ("running dogs", query_terms("runs dog"), "<mark>running</mark> <mark>dogs</mark>"),
    ("<b>cat</b>", {"cat"}, "&lt;b&gt;<mark>cat</mark>&lt;/b&gt;"),
    ('<img src=x onerror="alert(1)">', {"img"}, '&lt;<mark>img</mark> src=x onerror=&#34;alert(1)&#34;&gt;'),
    ("nothing here", set(), "nothing here"),
    (None, {"x"}, ""),
])
def test_highlight_escapes_then_marks(text: str | None, terms: set[str], expected: str) -> None:
    out = highlight(text, terms)
    assert isinstance(out, Markup) and str(out) == expected


def test_a_term_that_is_markup_is_still_escaped() -> None:
    assert "<script>" not in str(highlight("<script>x</script>", query_terms("<script>")))


def test_snippet_windows_around_the_first_match() -> None:
    text = " ".join(f"w{i}" for i in range(100)) + " astronaut " + " ".join(f"v{i}" for i in range(100))
    out = str(snippet(text, query_terms("astronaut"), words=20))
    assert "<mark>astronaut</mark>" in out and out.startswith("… ") and out.endswith(" …")
    assert len(out.split()) <= 24


@pytest.mark.parametrize("size, bucket, tier, expected", [
    ((2000, 1000), "1024x1024", 1024, {"x": 500, "y": 0, "width": 1000, "height": 1000}),
    ((1000, 2000), "1024x1024", 1024, {"x": 0, "y": 500, "width": 1000, "height": 1000}),
    ((1000, 1000), None, None, None),
    ((1000.0, 500.0), "1344x768", 1024, {"x": 62, "y": 0, "width": 875, "height": 500}),
])
def test_crop_rect(size: tuple, bucket: str | None, tier: int | None, expected: dict | None) -> None:
    assert crop_rect(*size, bucket, tier) == expected


def test_thumbnail_of_hostile_bytes_is_none_and_of_a_photo_is_bounded() -> None:
    assert make_thumbnail(b"not an image", 256) is None
    buffer = io.BytesIO()
    Image.new("RGB", (1200, 600), "red").save(buffer, "PNG")
    thumb = Image.open(io.BytesIO(make_thumbnail(buffer.getvalue(), 256)))
    assert thumb.format == "JPEG" and thumb.size == (256, 128)


def test_thumbnail_cache_is_bounded_in_bytes() -> None:
    cache = ThumbnailCache(max_bytes=25)
    for i in range(5):
        cache.put((str(i), 256), b"x" * 10)
    assert cache.bytes <= 25 and cache.get(("0", 256)) is None and cache.get(("4", 256)) == b"x" * 10


def test_a_thumbnail_decode_has_its_own_short_budget(monkeypatch) -> None:
    """A decode past the thumbnail budget is refused (None: the page's placeholder) by the
    pipeline's own deadline, which a real decode here spends at once with a zero budget."""
    from prx_core.image.budget import DEFAULT_DECODE_SECONDS
    from prx_core.image.decode import decode_image
    from prx_explorer import render

    buffer = io.BytesIO()
    Image.new("RGB", (1200, 600), "red").save(buffer, "JPEG")
    data = buffer.getvalue()
    assert render.THUMB_DECODE_SECONDS <= 5.0 < DEFAULT_DECODE_SECONDS
    assert decode_image(data, budget_s=0.0).reason == "decode_timeout"
    assert make_thumbnail(data, 256, budget_s=0.0) is None
    monkeypatch.setattr(render, "THUMB_DECODE_SECONDS", 0.0)  # the default comes from the constant
    assert make_thumbnail(data, 256) is None
    monkeypatch.undo()
    assert make_thumbnail(data, 256) is not None
