"""Thumbnail renders under a bound, so a CPU-bomb image in the corpus costs one short render.

One render per (content, size) however many requests ask for it at once (single-flight: the
others wait for its result), at most `renders` renders at a time, and at most `queue` more
requests waiting; a request beyond that is refused at once (`Busy`: a 503 with Retry-After)
rather than holding one of the server's threads. Each render decodes under the thumbnail decode
budget (`render.THUMB_DECODE_SECONDS`); bytes that do not decode within it are remembered as
`REFUSED` and answered with a placeholder image, never rendered again while cached.
"""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from prx_explorer.render import ThumbnailCache, make_thumbnail
from prx_explorer.scans import Busy
from prx_explorer.view import View, one_row

REFUSED = b""  # the cached outcome of bytes that did not decode
RENDERS = 2  # at a time: each holds a core for up to the decode budget
QUEUE = 8  # requests waiting for a render (theirs or another's) beyond those
WAIT_SECONDS = 30.0  # the longest a request waits for a render slot or another request's render
BUSY_TEXT = "busy: reload"  # the image a 503 carries

Key = tuple[str, int]


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    result: bytes | None = None  # None: the render failed; waiters give up too


class ThumbnailRenders:
    """The cache in front, single-flight and the two bounds behind it; thread-safe (Starlette
    serves sync endpoints from a thread pool)."""

    def __init__(self, cache: ThumbnailCache, renders: int = RENDERS, queue: int = QUEUE,
                 wait_s: float = WAIT_SECONDS) -> None:
        self.cache, self.renders, self.queue, self.wait_s = cache, renders, queue, wait_s
        self._slots = threading.Semaphore(renders)
        self._lock = threading.Lock()
        self._flights: dict[Key, _Flight] = {}
        self.pending = 0  # requests past a cache miss: rendering or waiting
        self.started = 0  # renders run
        self.busy = 0  # requests refused with Busy

    def get(self, key: Key, render: Callable[[], bytes | None]) -> bytes:
        """The thumbnail for `key` (`REFUSED` when its bytes do not decode), rendered by
        `render` only when neither the cache nor a running render has it; raises `Busy`."""
        if (found := self.cache.get(key)) is not None:
            return found
        with self._lock:
            flight = self._flights.get(key)
            if flight is None and (found := self.cache.peek(key)) is not None:
                return found  # rendered between the miss and the lock
            if self.pending >= self.renders + self.queue:
                self.busy += 1
                raise Busy
            self.pending += 1
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        try:
            return self._lead(key, flight, render) if leader else self._follow(flight)
        finally:
            with self._lock:
                self.pending -= 1

    def _lead(self, key: Key, flight: _Flight, render: Callable[[], bytes | None]) -> bytes:
        try:
            if not self._slots.acquire(timeout=self.wait_s):
                with self._lock:
                    self.busy += 1
                raise Busy
            try:
                with self._lock:
                    self.started += 1
                data = render()
            finally:
                self._slots.release()
            flight.result = REFUSED if data is None else data
            self.cache.put(key, flight.result)
            return flight.result
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.done.set()

    def _follow(self, flight: _Flight) -> bytes:
        if not flight.done.wait(self.wait_s) or flight.result is None:
            with self._lock:
                self.busy += 1
            raise Busy
        return flight.result

    def stats(self) -> dict[str, int]:
        return {"hits": self.cache.hits, "misses": self.cache.misses, "renders": self.started, "busy": self.busy,
                "pending": self.pending}


def render_thumbnail(view: View, sample_id: str, size: int) -> bytes | None:
    """The stored image of the sample as a thumbnail (a BTREE lookup of one row's bytes)."""
    row = one_row(view.table("samples"), "sample_id", sample_id, ["image"])
    return make_thumbnail(row["image"], size) if row and row["image"] else None


@functools.lru_cache(maxsize=8)
def placeholder(size: int, text: str = "no preview") -> bytes:
    """A plain grey JPEG saying `text`: what a page shows for an image that does not decode, or
    (with a 503) while every render slot is taken, instead of a broken image."""
    image = Image.new("RGB", (size, size * 3 // 4), (221, 221, 221))
    ImageDraw.Draw(image).text((size // 10, size * 3 // 8 - 6), text, fill=(102, 102, 102))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=75)
    return out.getvalue()
