"""http(s) fetches of a batch's image URLs (aiohttp, one event loop and session per batch).

Bounded: at most `concurrency` requests of the batch in flight and `per_host` to one host:port;
each attempt has a connect timeout, a read timeout (the longest silence) and a whole-attempt
timeout. A 429, a 5xx or a dropped connection is retried `retries` times with exponential backoff
(`backoff_s`, doubled each time; a `Retry-After` up to `retry_after_max_s` is waited instead when
longer). Redirects are followed up to `max_redirects`, to http(s) targets only; a loop stops at
once. A 200 whose Content-Type is `text/*` is a page, not an image (`download_error`). The size
cap holds from `Content-Length` and again while the body streams in (a body with no length, or a
compressed one, is counted as it is decoded). Timeouts are not retried: a server that stalls once
for `read_timeout_s` would hold the worker as long again. Proxy variables and .netrc are not read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from prx_core.compute.retries import retry_after_seconds
from prx_core.sources.records import DOWNLOAD_ERROR, DOWNLOAD_TIMEOUT, IMAGE_TOO_LARGE, OPTED_OUT
from prx_core.sources.robots import agent_token, opt_out

REDIRECTS = (301, 302, 303, 307, 308)
CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class Fetched:
    """What one URL gave: its bytes, or a reject reason and its cause (the URL is added by the caller)."""

    data: bytes | None = None
    reason: str | None = None
    cause: str = ""


@dataclass(frozen=True)
class _Again:
    """A response worth another attempt (429, 5xx, a dropped connection)."""

    cause: str
    retry_after: float | None = None


def fetch_http(urls: list[str], settings: Any, max_bytes: int) -> list[Fetched]:
    """Fetch `urls` (http or https) with `settings` (`DownloadSettings`), in order. Runs its own event
    loop: in a thread of its own when the calling thread already runs one (an async Ray actor)."""
    def main() -> list[Fetched]:
        return asyncio.run(_fetch_all(urls, settings, max_bytes))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return main()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(main).result()


async def _fetch_all(urls: list[str], settings: Any, max_bytes: int) -> list[Fetched]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=settings.connect_timeout_s,
                                    sock_read=settings.read_timeout_s)
    connector = aiohttp.TCPConnector(limit=settings.concurrency, limit_per_host=settings.per_host)
    slots = asyncio.Semaphore(settings.concurrency)
    hosts: dict[str, asyncio.Semaphore] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                     headers={"User-Agent": settings.user_agent}) as session:
        async def one(url: str) -> Fetched:
            async with slots:
                return await _fetch(session, hosts, url, settings, max_bytes)

        return list(await asyncio.gather(*(one(url) for url in urls)))


async def _fetch(session: Any, hosts: dict[str, asyncio.Semaphore], url: str, settings: Any,
                 max_bytes: int) -> Fetched:
    """One URL, retried after a 429, a 5xx or a dropped connection; every error is a `Fetched`."""
    import aiohttp

    for attempt in range(settings.retries + 1):
        try:
            async with asyncio.timeout(settings.attempt_timeout_s):
                outcome = await _attempt(session, hosts, url, settings, max_bytes)
        except TimeoutError as exc:  # aiohttp's socket timeouts are TimeoutErrors too
            return Fetched(reason=DOWNLOAD_TIMEOUT, cause=_timeout_cause(exc, settings))
        except aiohttp.ClientConnectorError as exc:  # refused, unresolvable: another try would say the same
            return Fetched(reason=DOWNLOAD_ERROR, cause=f"cannot connect: {_describe(exc)}")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
            outcome = _Again(f"connection dropped: {_describe(exc)}")
        except Exception as exc:  # a malformed response, a bad URL: this row's cause, never the unit's failure
            return Fetched(reason=DOWNLOAD_ERROR, cause=_describe(exc))
        if isinstance(outcome, Fetched):
            return outcome
        tries = f"after {attempt + 1} attempt{'s' if attempt else ''}"
        if attempt == settings.retries:
            return Fetched(reason=DOWNLOAD_ERROR, cause=f"{outcome.cause} {tries}")
        wait = settings.backoff_s * 2 ** attempt
        if outcome.retry_after is not None:
            if outcome.retry_after > settings.retry_after_max_s:
                return Fetched(reason=DOWNLOAD_ERROR, cause=f"{outcome.cause} {tries}, Retry-After "
                               f"{outcome.retry_after:.0f} s over the {settings.retry_after_max_s:g} s waited at most")
            wait = max(wait, outcome.retry_after)
        await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def _attempt(session: Any, hosts: dict[str, asyncio.Semaphore], url: str, settings: Any,
                   max_bytes: int) -> Fetched | _Again:
    """One attempt: redirects followed by hand (each target checked), then the body under the cap."""
    from yarl import URL

    current = URL(url)
    seen = {str(current)}
    for _ in range(settings.max_redirects + 1):
        host = hosts.setdefault(f"{current.host}:{current.port}", asyncio.Semaphore(settings.per_host))
        async with host, session.get(current, allow_redirects=False) as response:
            status = response.status
            if status in REDIRECTS:
                location = response.headers.get("Location")
                if not location:
                    return Fetched(reason=DOWNLOAD_ERROR, cause=f"HTTP {status} without a Location")
                target = current.join(URL(location))
                if target.scheme not in ("http", "https"):
                    return Fetched(reason=DOWNLOAD_ERROR, cause=f"redirect to a non-http(s) URL refused: "
                                                                f"{str(target)[:80]}")
                if str(target) in seen:
                    return Fetched(reason=DOWNLOAD_ERROR, cause=f"redirect loop (back to {str(target)[:80]})")
                seen.add(str(target))
                current = target
                continue
            if status == 429 or status >= 500:
                return _Again(f"HTTP {status} {response.reason or ''}".strip(), retry_after_seconds(response.headers.get("Retry-After")))
            if status != 200:
                return Fetched(reason=DOWNLOAD_ERROR, cause=f"HTTP {status} {response.reason or ''}".strip())
            if settings.honor_opt_out:
                refusal = opt_out(response.headers.getall("X-Robots-Tag", []), agent_token(settings.user_agent))
                if refusal:
                    return Fetched(reason=OPTED_OUT, cause=f"X-Robots-Tag: {refusal}")
            kind = response.headers.get("Content-Type", "")
            if kind.lower().startswith("text/"):  # a page where an image was expected (a soft 404, a login wall)
                return Fetched(reason=DOWNLOAD_ERROR, cause=f"HTTP 200 with Content-Type {kind[:40]}, not an image")
            return await _body(response, max_bytes)
    return Fetched(reason=DOWNLOAD_ERROR, cause=f"more than {settings.max_redirects} redirects")


async def _body(response: Any, max_bytes: int) -> Fetched:
    """The body, refused as soon as it is known to exceed `max_bytes` (from its length, or read so far)."""
    length = response.content_length
    if length is not None and length > max_bytes:
        return Fetched(reason=IMAGE_TOO_LARGE, cause=f"Content-Length {length} bytes, over the limit {max_bytes}")
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            said = " (no Content-Length said so)" if length is None else f" (Content-Length said {length})"
            return Fetched(reason=IMAGE_TOO_LARGE, cause=f"body over the limit {max_bytes} bytes{said}")
    return Fetched(data=bytes(body))


def _timeout_cause(exc: BaseException, settings: Any) -> str:
    import aiohttp

    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"no connection within {settings.connect_timeout_s:g} s"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return f"no data for {settings.read_timeout_s:g} s"
    return f"not done within {settings.attempt_timeout_s:g} s"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160]
