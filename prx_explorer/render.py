"""What pages show, made safe: captions escaped with query terms marked, thumbnails decoded by
the pipeline's own safe decoder (hostile bytes are already in the corpus), the crop a bucket
implies."""

from __future__ import annotations

import io
import re
import threading
from collections import OrderedDict

from markupsafe import Markup, escape
from PIL import Image

from prx_core.image.buckets import Bucket, crop_box
from prx_core.image.decode import Rejection, decode_image
from prx_explorer.disk_cache import DiskThumbnails

THUMB_SIZES = (256, 768)
THUMB_DECODE_SECONDS = 5.0  # per thumbnail; the pipeline's budget is 30 s (prx_core.image.budget)
_WORD = re.compile(r"\w+", re.UNICODE)
_SUFFIXES = ("ing", "ed", "es", "s")


def _stem(word: str) -> str:
    """A crude stemmer matching Lance's tokenizer closely enough to mark what matched."""
    word = word.lower()
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[: -len(suffix)]
            doubled = suffix in ("ing", "ed") and stem[-1] == stem[-2] and stem[-1] not in "aeiouls"
            return stem[:-1] if doubled else stem  # running -> run, but falling -> fall
    return word


def stems(text: str) -> list[str]:
    """The words of `text`, in order, as `highlight` compares them (lower case, stemmed)."""
    return [_stem(w) for w in _WORD.findall(text)]


def query_terms(text: str) -> set[str]:
    return set(stems(text))


def highlight(text: str | None, terms: set[str]) -> Markup:
    """`text` escaped, with words whose stem is a query term wrapped in <mark>."""
    text = text or ""
    if not terms:
        return escape(text)
    parts: list[str] = []
    last = 0
    for match in _WORD.finditer(text):
        if _stem(match.group()) in terms:
            parts += [escape(text[last:match.start()]), Markup("<mark>{}</mark>").format(match.group())]
            last = match.end()
    parts.append(escape(text[last:]))
    return Markup("").join(parts)


def snippet(text: str | None, terms: set[str], words: int = 40) -> Markup:
    """The first `words` words, or a window around the first marked term."""
    tokens = (text or "").split()
    if len(tokens) <= words:
        return highlight(text, terms)
    start = next((i for i, t in enumerate(tokens) if any(_stem(w) in terms for w in _WORD.findall(t))), 0)
    start = max(0, min(start - words // 4, len(tokens) - words))
    cut = " ".join(tokens[start:start + words])
    return Markup("{}{}{}").format("… " if start else "", highlight(cut, terms), " …" if start + words < len(tokens) else "")


def make_thumbnail(data: bytes, size: int, budget_s: float | None = None) -> bytes | None:
    """A JPEG at most `size` on its long side, or None when the bytes do not decode within
    `budget_s` (default `THUMB_DECODE_SECONDS`: a page waits on it, a pipeline stage does not)."""
    budget = THUMB_DECODE_SECONDS if budget_s is None else budget_s
    decoded = decode_image(data, min_size=(size, size), budget_s=budget)
    if isinstance(decoded, Rejection):
        return None
    image = decoded.image
    image.thumbnail((size, size), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=85)
    return out.getvalue()


class ThumbnailCache:
    """LRU of encoded thumbnails by (content_id, size), bounded in bytes, in front of an optional
    disk cache (`disk_cache.DiskThumbnails`: what outlives the process); thread-safe because
    Starlette serves sync endpoints from a thread pool."""

    def __init__(self, max_bytes: int = 64 << 20, disk: DiskThumbnails | None = None) -> None:
        self.max_bytes, self.bytes, self.disk = max_bytes, 0, disk
        self._items: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.disk_hits = 0

    def get(self, key: tuple[str, int]) -> bytes | None:
        with self._lock:
            if (value := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return value
        if self.disk is not None and (value := self.disk.get(key)) is not None:
            self._remember(key, value)
            with self._lock:
                self.hits += 1
                self.disk_hits += 1
            return value
        with self._lock:
            self.misses += 1
        return None

    def peek(self, key: tuple[str, int]) -> bytes | None:
        """The value, not counted as a hit or a miss and not refreshed."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: tuple[str, int], value: bytes) -> None:
        if self.disk is not None:
            self.disk.put(key, value)
        self._remember(key, value)

    def _remember(self, key: tuple[str, int], value: bytes) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self.bytes += len(value)
            while self.bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self.bytes -= len(dropped)


def crop_rect(width: int, height: int, bucket_name: str | None, tier: int | None) -> dict[str, int] | None:
    """The bucket's centred crop in original pixels, for an SVG overlay in the same coordinates."""
    match = re.fullmatch(r"(\d+)x(\d+)", bucket_name or "")
    if not match or not width or not height or tier is None:
        return None
    width, height = int(width), int(height)
    left, top, right, bottom = crop_box(width, height, Bucket(int(tier), int(match[1]), int(match[2])))
    return {"x": left, "y": top, "width": right - left, "height": bottom - top}
