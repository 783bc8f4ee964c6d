"""A loopback HTTP server for the downloader tests: real photos and every way a fetch goes wrong.

Bound to 127.0.0.1 on a free port, one daemon thread per connection, each socket with a timeout,
stopped by the fixture that starts it. Every request is logged (path, user agent, time), so a test
can tell what was fetched, how often and when. Routes (`<photo>` names a photo the server holds;
anything may follow it, so URLs can be unique):

    /photo/<photo>/...      200, the photo                 /missing/...       404
    /flaky/<photo>/...      500 the first time, then 200   /drop/<photo>/...  connection closed unanswered, then 200
    /throttle/<photo>/...   429 Retry-After: 1, then 200   /slow/...          headers, then SLOW_S of silence
    /big/...                BIG_BYTES with Content-Length  /big-unsized/...   BIG_BYTES, no length (close-delimited)
    /loop/a, /loop/b        302 to each other              /to-file/...       302 to file:///etc/passwd
    /redirect/<photo>/...   302 to /photo/<photo>/...      /noai/<photo>/...  200 with X-Robots-Tag: noai
    /otherbot/<photo>/...   X-Robots-Tag: otherbot: noai   /ours/<photo>/...  X-Robots-Tag: prx-corpus: noimageai
    /hold/<photo>/...       200 after HOLD_S (the peak of requests in flight is kept per Host header)
    /throttle-long/...      429 Retry-After: 3600          /fail/...          503, always
    /page/...               200, an HTML page (text/html)
    /to-host/<host>/<photo>/...  302 to http://<host>:<this port>/photo/<photo>/... (another address)
    /i2d/<photo>/...        200 with X-Robots-Tag: img2dataset: noai
    /drip/<photo>/...       200 with the photo's Content-Length, then one byte every DRIP_GAP_S for
                            DRIP_S (or the seconds in a `?s=` query), then the connection dropped
"""

from __future__ import annotations

import io
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_S = 3.0
DRIP_S = 2.0
DRIP_GAP_S = 0.05
BIG_BYTES = 2 << 20
HOLD_S = 0.3
PHOTO_NAMES = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle_left")


def load_photos(max_side: int = 480, quality: int = 85) -> dict[str, bytes]:
    """scikit-image's photos, downscaled to at most `max_side` (their short sides stay over 384 where
    they were), as JPEG."""
    import skimage
    from PIL import Image

    out = {}
    for name in PHOTO_NAMES:
        image = Image.fromarray(getattr(skimage.data, name)() if name != "motorcycle_left" else
                                skimage.data.stereo_motorcycle()[0]).convert("RGB")
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=quality)
        out[name] = buffer.getvalue()
    return out


@dataclass(frozen=True)
class Request:
    path: str
    user_agent: str
    at: float


class PhotoServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, photos: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.photos = photos
        self.log: list[Request] = []
        self.seen: Counter[str] = Counter()
        self.inflight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()  # per Host header, and "" for all hosts together
        self.lock = threading.Lock()

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # a client that left is no error
            super().handle_error(request, client_address)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def note(self, path: str, user_agent: str) -> int:
        """Log a request; how many times this path was asked before."""
        with self.lock:
            self.log.append(Request(path, user_agent, time.monotonic()))
            self.seen[path] += 1
            return self.seen[path] - 1

    def hold(self, host: str) -> None:
        """Answer a /hold request after HOLD_S, counting the requests in flight meanwhile."""
        with self.lock:
            for name in (host, ""):
                self.inflight[name] += 1
                self.peak[name] = max(self.peak[name], self.inflight[name])
        time.sleep(HOLD_S)
        with self.lock:
            for name in (host, ""):
                self.inflight[name] -= 1

    def paths(self) -> list[str]:
        with self.lock:
            return [r.path for r in self.log]

    def clear(self) -> None:
        with self.lock:
            self.log.clear()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall between
    timeout = 20  # a client that stalls cannot hold a thread for long
    server: PhotoServer

    def log_message(self, format: str, *args: object) -> None:  # quiet: the server keeps its own log
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        before = self.server.note(self.path, self.headers.get("User-Agent", ""))
        route, _, rest = self.path.lstrip("/").partition("/")
        photo = self.server.photos.get(rest.split("/", 1)[0])
        try:
            self.answer(route, photo, before)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a size cap, a timeout)
            self.close_connection = True

    def answer(self, route: str, photo: bytes | None, before: int) -> None:
        if route == "loop":
            return self.redirect("/loop/b" if self.path == "/loop/a" else "/loop/a")
        if route == "to-file":
            return self.redirect("file:///etc/passwd")
        if route == "to-host":
            host, _, rest = urllib.parse.unquote(self.path).split("/", 2)[2].partition("/")
            return self.redirect(f"http://{host}:{self.server.server_address[1]}/photo/{rest}")
        if route == "slow":
            self.head(200, 4)
            time.sleep(SLOW_S)
            return self.body(b"late")
        if route in ("big", "big-unsized"):
            return self.big(sized=route == "big")
        if route == "page":
            return self.send(200, b"<html><body>Sign in to see this image</body></html>", "text/html; charset=utf-8")
        if route == "fail":
            return self.send(503, b"down", "text/plain")
        if route == "throttle-long":
            return self.send(429, b"come back tomorrow", "text/plain", {"Retry-After": "3600"})
        if photo is None:
            return self.send(404, b"not found", "text/plain")
        if route == "redirect":
            return self.redirect("/photo/" + self.path.split("/", 2)[2])
        if route == "flaky" and before == 0:
            return self.send(500, b"try again", "text/plain")
        if route == "throttle" and before == 0:
            return self.send(429, b"slow down", "text/plain", {"Retry-After": "1"})
        if route == "hold":
            self.server.hold(self.headers.get("Host", ""))
        if route == "drop" and before == 0:
            self.close_connection = True
            return None
        if route == "drip":
            return self.drip(photo)
        robots = {"noai": "noai", "otherbot": "otherbot: noai", "ours": "prx-corpus: noimageai",
                  "i2d": "img2dataset: noai"}.get(route)
        if route not in ("photo", "flaky", "throttle", "drop", "hold") and robots is None:
            return self.send(404, b"no such route", "text/plain")
        return self.send(200, photo, "image/jpeg", {"X-Robots-Tag": robots} if robots else {})

    def head(self, status: int, length: int | None, kind: str = "application/octet-stream",
             headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if length is None:
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(length))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()

    def body(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def send(self, status: int, data: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.head(status, len(data), kind, headers)
        self.body(data)

    def redirect(self, location: str) -> None:
        self.send(302, b"", "text/plain", {"Location": location})

    def drip(self, photo: bytes) -> None:
        """Headers promising the photo, a byte at a time for a while, then the connection dropped."""
        seconds = float(self.path.partition("?s=")[2] or DRIP_S)
        self.head(200, len(photo), "image/jpeg")
        until, sent = time.monotonic() + seconds, 0
        while time.monotonic() < until and sent < len(photo) - 1:
            self.body(photo[sent:sent + 1])
            sent += 1
            time.sleep(DRIP_GAP_S)
        self.close_connection = True

    def big(self, sized: bool) -> None:
        self.head(200, BIG_BYTES if sized else None, "image/jpeg")
        block = b"\xff" * (64 << 10)
        for _ in range(BIG_BYTES // len(block)):
            self.wfile.write(block)


@contextmanager
def serving(photos: dict[str, bytes]) -> Iterator[PhotoServer]:
    """A `PhotoServer` answering in a daemon thread until the block ends."""
    server = PhotoServer(photos)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
