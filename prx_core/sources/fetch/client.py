"""http(s) fetches of image URLs (aiohttp), one session per reader (`prx_core.sources.fetch.window`).

Bounded: at most `per_host` requests to one host:port (the window bounds them all); each attempt
has a connect timeout, a read timeout (the longest silence) and a whole-attempt timeout, and each
URL one deadline across all its attempts, redirects and backoff waits (`url_deadline_s`), or the
unit's own time for fetching when that ends first. A 429, a 5xx or a connection dropped soon
(within `retry_within_s`) is retried `retries` times with exponential backoff (`backoff_s`,
doubled each time; a `Retry-After` up to `retry_after_max_s` is waited instead when longer); a
connection that dropped after streaming longer is not (a host dripping bytes would hold the row
as long again). Redirects are followed up to `max_redirects`, to http(s) targets only; a loop
stops at once. A 200 whose Content-Type is `text/*` is a page, not an image (`download_error`).
The size cap holds from `Content-Length` and again while the body streams in (a body with no
length, or a compressed one, is counted as it is decoded). Timeouts are not retried. Proxy
variables and .netrc are not read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prx_core.compute.retries import retry_after_seconds
from prx_core.sources.fetch.policy import AddressRefused, FetchPolicy, guarded_resolver
from prx_core.sources.fetch.robots import agent_token, opt_out
from prx_core.sources.records import (
    DOWNLOAD_ERROR,
    DOWNLOAD_TIMEOUT,
    IMAGE_TOO_LARGE,
    NOT_FETCHED,
    OPTED_OUT,
    URL_NOT_ALLOWED,
)

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
    """A response worth another attempt (429, 5xx, a connection dropped soon)."""

    cause: str
    retry_after: float | None = None


class HttpClient:
    """One aiohttp session and its per-host semaphores, used from one event loop."""

    def __init__(self, settings: Any, max_bytes: int, policy: FetchPolicy | None = None) -> None:
        import aiohttp

        self.settings, self.max_bytes = settings, max_bytes
        self.policy = policy or FetchPolicy(settings)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=settings.connect_timeout_s,
                                        sock_read=settings.read_timeout_s)
        connector = aiohttp.TCPConnector(limit=settings.concurrency, limit_per_host=settings.per_host,
                                         resolver=guarded_resolver(self.policy))
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                             headers={"User-Agent": settings.user_agent})
        self.hosts: dict[str, asyncio.Semaphore] = {}

    async def close(self) -> None:
        await self.session.close()

    async def fetch(self, url: str, deadline: float | None, on_bytes: Callable[[int], None]) -> Fetched:
        """One URL within its own deadline and `deadline` (the unit's, on the loop's clock); every error
        is a `Fetched`. `on_bytes(n)` hears of each piece of body as it streams in."""
        loop, settings = asyncio.get_running_loop(), self.settings
        began = loop.time()
        own = began + settings.url_deadline_s
        end = own if deadline is None else min(own, deadline)
        attempts = [0]
        try:
            async with asyncio.timeout_at(end):
                return await self._attempts(url, on_bytes, attempts)
        except TimeoutError:
            spent = loop.time() - began
            tries = f"{attempts[0]} attempt{'s' if attempts[0] != 1 else ''}"
            if end < own:
                return Fetched(reason=NOT_FETCHED, cause=f"the unit's time for fetching ran out {spent:.0f} s into "
                                                         f"this URL ({tries})")
            return Fetched(reason=DOWNLOAD_TIMEOUT, cause=f"not done within the URL deadline of "
                                                          f"{settings.url_deadline_s:g} s ({tries})")

    async def _attempts(self, url: str, on_bytes: Callable[[int], None], attempts: list[int]) -> Fetched:
        import aiohttp

        loop, settings = asyncio.get_running_loop(), self.settings
        for attempt in range(settings.retries + 1):
            attempts[0] = attempt + 1
            started = loop.time()
            try:
                async with asyncio.timeout(settings.attempt_timeout_s):
                    outcome = await _attempt(self, url, on_bytes)
            except TimeoutError as exc:  # aiohttp's socket timeouts are TimeoutErrors too
                return Fetched(reason=DOWNLOAD_TIMEOUT, cause=_timeout_cause(exc, settings))
            except aiohttp.ClientConnectorError as exc:  # refused, unresolvable: another try would say the same
                if isinstance(exc.os_error, AddressRefused):  # the host resolved to addresses the source may not reach
                    return Fetched(reason=URL_NOT_ALLOWED, cause=str(exc.os_error)[:200])
                return Fetched(reason=DOWNLOAD_ERROR, cause=f"cannot connect: {_describe(exc)}")
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
                lasted = loop.time() - started
                if lasted > settings.retry_within_s:  # it streamed long: a retry would hold the row as long again
                    return Fetched(reason=DOWNLOAD_ERROR, cause=f"connection dropped {lasted:.0f} s into attempt "
                                                                f"{attempt + 1}, not retried: {_describe(exc)}")
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


async def _attempt(client: HttpClient, url: str, on_bytes: Callable[[int], None]) -> Fetched | _Again:
    """One attempt: redirects followed by hand (each target checked: its scheme, an IP literal's
    address; a name's addresses are checked by the resolver), then the body under the cap."""
    from yarl import URL

    settings, max_bytes = client.settings, client.max_bytes
    current = URL(url)
    seen = {str(current)}
    for _ in range(settings.max_redirects + 1):
        refused = client.policy.address_refusal(current.host or "")
        if refused:
            hop = "" if len(seen) == 1 else f"redirected to {str(current)[:80]}: "
            return Fetched(reason=URL_NOT_ALLOWED, cause=hop + refused)
        host = client.hosts.setdefault(f"{current.host}:{current.port}", asyncio.Semaphore(settings.per_host))
        async with host, client.session.get(current, allow_redirects=False) as response:
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
                refusal = opt_out(response.headers.getall("X-Robots-Tag", []),
                                  [agent_token(settings.user_agent), *settings.opt_out_agents])
                if refusal:
                    return Fetched(reason=OPTED_OUT, cause=f"X-Robots-Tag: {refusal}")
            kind = response.headers.get("Content-Type", "")
            if kind.lower().startswith("text/"):  # a page where an image was expected (a soft 404, a login wall)
                return Fetched(reason=DOWNLOAD_ERROR, cause=f"HTTP 200 with Content-Type {kind[:40]}, not an image")
            return await _body(response, max_bytes, on_bytes)
    return Fetched(reason=DOWNLOAD_ERROR, cause=f"more than {settings.max_redirects} redirects")


async def _body(response: Any, max_bytes: int, on_bytes: Callable[[int], None]) -> Fetched:
    """The body, refused as soon as it is known to exceed `max_bytes` (from its length, or read so far)."""
    length = response.content_length
    if length is not None and length > max_bytes:
        return Fetched(reason=IMAGE_TOO_LARGE, cause=f"Content-Length {length} bytes, over the limit {max_bytes}")
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        on_bytes(len(chunk))
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
