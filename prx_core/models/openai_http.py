"""One HTTP client for OpenAI-compatible `/chat/completions` endpoints (`vllm serve`, hosted).

Shared by the `openai` captioner (prx_core.models.captioning_openai) and the `llm` labeller over HTTP
(prx_core.models.labels_llm) so that both get the same transport guarantees from one place:
  * at most `concurrency` requests in flight; a slot is held for one attempt, not while
    backing off, so a throttled request does not idle a slot others could use;
  * a `timeout_s` deadline per attempt (the wait for a slot is not part of it);
  * 408, 409, 429, 5xx, timeouts and connection errors retried up to `max_retries` times with
    exponential backoff and full jitter (first cap `backoff_s`, capped at 30 s); a
    `Retry-After` header (seconds or an HTTP date, capped at 120 s) is a floor;
  * `Authorization: Bearer <key>` from the environment variable NAMED in the config, never over
    plain `http://` to a host that is not loopback unless `allow_insecure_http` (`check_endpoint`),
    and never to a redirect target (redirects are not followed: a 3xx is a failed request);
  * a response body bigger than `max_response_bytes` (a Content-Length saying so, or the bytes
    read so far) is a failed request (TOO_LARGE), read no further: the server is not trusted to
    bound what it sends.

The client never raises for a failed request: each one ends as a `Reply`, the body of a 200 or
what went wrong on the last attempt, and each backend maps that to its own stored error codes.
A 200 whose body is not a chat completion is `parse_chat`'s `BadResponse`, whatever it holds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from prx_core.compute.retries import retry_after_seconds

RETRYABLE_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 120.0
HTTP, TIMEOUT, CONNECTION, TOO_LARGE = "http", "timeout", "connection", "too_large"  # Reply.failure
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20  # a chat completion of a caption or a label is a few KB
MAX_ERROR_BODY_BYTES = 64 << 10  # of a non-200 body, only what an error message needs is read
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})


class BadResponse(ValueError):
    """A 200 whose body is not a chat completion (`parse_chat`); the per-request failure."""


BAD_SHAPE = (BadResponse,)  # what `parse_chat` raises, and all it raises

T = TypeVar("T")
R = TypeVar("R")


class Transport(Protocol):
    """The config fields the client reads (CaptionerConfig and LabelerConfig both have them)."""

    endpoint: str
    api_key_env: str
    concurrency: int
    timeout_s: float
    max_retries: int
    backoff_s: float
    max_response_bytes: int
    allow_insecure_http: bool


@dataclass(frozen=True)
class Reply:
    """How one request ended: `text` is the body of a 200, else `failure` says why."""

    text: str | None
    attempts: int
    failure: str = ""  # HTTP | TIMEOUT | CONNECTION | TOO_LARGE when text is None
    status: int | None = None  # HTTP: the last status
    detail: str = ""  # HTTP: the response body (its first 64 KiB); CONNECTION: "<exception type>: <message>"


Post = Callable[[Mapping[str, Any]], Awaitable[Reply]]


def auth_headers(api_key_env: str | None) -> dict[str, str]:
    """JSON headers, with `Bearer <key>` read from the environment variable NAMED in the config."""
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"environment variable {api_key_env!r} (the API key) is not set")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8, ::1 (and IPv4-mapped 127/8), as written: a name is never
    resolved, since what it resolves to can change between the check and the request."""
    host = host.lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def check_endpoint(endpoint: str, api_key_env: str | None, allow_insecure_http: bool = False,
                   max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
    """The operator's mistakes, refused before any request: a URL that is not http(s), an API key
    sent in clear text over the network, a response cap below 1 KiB."""
    if not isinstance(max_response_bytes, int) or max_response_bytes < 1024:
        raise ValueError(f"max_response_bytes must be an integer >= 1024, got {max_response_bytes!r}")
    if not endpoint:
        return  # the configs say which backend needs one
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {endpoint!r} is not an http:// or https:// URL with a host")
    if parts.scheme == "http" and api_key_env and not allow_insecure_http and not is_loopback(parts.hostname):
        raise ValueError(
            f"refusing to send the API key (${api_key_env}) in clear text to {endpoint!r}: use https://, a loopback "
            f"host (localhost, 127.0.0.1, ::1), or set allow_insecure_http: true if this network is trusted")


def chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/chat/completions") else base + "/chat/completions"


def parse_chat(text: str) -> tuple[Any, Any]:
    """(`choices[0].message.content`, the decoded body) of a 200; `BadResponse` for anything else
    (not JSON, nested beyond the parser's recursion limit, not the shape of a completion)."""
    try:
        body = json.loads(text)
        return body["choices"][0]["message"]["content"], body
    except (ValueError, KeyError, IndexError, TypeError, RecursionError, MemoryError) as exc:
        raise BadResponse(f"{type(exc).__name__}: {str(exc)[:200]}") from None


class ChatClient:
    """Posts chat-completions bodies with the bounds and retries of the module docstring."""

    def __init__(self, transport: Transport) -> None:
        self.max_response_bytes = getattr(transport, "max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
        check_endpoint(transport.endpoint, transport.api_key_env, getattr(transport, "allow_insecure_http", False),
                       self.max_response_bytes)
        self.url = chat_url(transport.endpoint)
        self.headers = auth_headers(transport.api_key_env)
        self.concurrency = transport.concurrency
        self.timeout_s = transport.timeout_s
        self.max_retries = transport.max_retries
        self.backoff_s = transport.backoff_s
        self._random = random.Random()

    def gather(self, items: Sequence[T], handle: Callable[[T, Post], Awaitable[R]]) -> list[R]:
        """`handle(item, post)` for every item concurrently, results in input order; callable from
        any thread. `handle` does its CPU work before its first await and calls `post(body)`."""
        if not items:
            return []
        return run_coroutine(self._gather(list(items), handle))

    async def _gather(self, items: list[T], handle: Callable[[T, Post], Awaitable[R]]) -> list[R]:
        import aiohttp

        semaphore = asyncio.Semaphore(self.concurrency)
        connector = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(connector=connector, headers=self.headers) as session:

            async def post(body: Mapping[str, Any]) -> Reply:
                return await self._post(session, semaphore, json.dumps(body).encode())

            return list(await asyncio.gather(*(handle(item, post) for item in items)))

    async def _post(self, session: Any, semaphore: asyncio.Semaphore, payload: bytes) -> Reply:
        attempts = 0
        while True:
            async with semaphore:
                attempts += 1
                reply, retryable, retry_after = await self._attempt(session, payload, attempts)
            if not retryable or attempts > self.max_retries:
                return reply
            await asyncio.sleep(self.backoff(attempts, retry_after))

    async def _attempt(self, session: Any, payload: bytes, attempts: int) -> tuple[Reply, bool, float | None]:
        """One POST: (reply, retryable, Retry-After seconds)."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.post(self.url, data=payload, timeout=timeout, allow_redirects=False) as response:
                ok = response.status == 200
                data = await read_capped(response, self.max_response_bytes if ok else MAX_ERROR_BODY_BYTES)
                if data is None and ok:
                    return Reply(None, attempts, TOO_LARGE, 200, f"the body exceeds {self.max_response_bytes} bytes"), \
                        False, None
                text = decode_body(data or b"", response.charset)
                if ok:
                    return Reply(text, attempts), False, None
                hint = retry_after_seconds(response.headers.get("Retry-After"))
                return Reply(None, attempts, HTTP, response.status, text), response.status in RETRYABLE_STATUS, hint
        except asyncio.TimeoutError:
            return Reply(None, attempts, TIMEOUT), True, None
        except aiohttp.ClientError as exc:  # refused, reset, disconnected, payload errors
            return Reply(None, attempts, CONNECTION, detail=f"{type(exc).__name__}: {exc}"), True, None

    def backoff(self, attempts: int, retry_after: float | None) -> float:
        """Full jitter on an exponential cap; a server's Retry-After is a floor."""
        jitter = self._random.uniform(0, min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempts - 1)))
        return max(jitter, min(retry_after, MAX_RETRY_AFTER_S)) if retry_after is not None else jitter


async def read_capped(response: Any, limit: int) -> bytes | None:
    """At most `limit` bytes of the body; None (and the rest unread) when it is longer, or when
    its Content-Length says it will be. An error body is merely cut (a status says enough)."""
    if response.status == 200 and response.content_length is not None and response.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await response.content.read(min(1 << 16, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None if response.status == 200 else b"".join(chunks)[:limit]


def decode_body(data: bytes, charset: str | None) -> str:
    try:
        return data.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return data.decode("utf-8", errors="replace")


def run_coroutine(coroutine: Any) -> Any:
    """asyncio.run, also from a thread whose event loop is already running (an async Ray actor)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="openai-http")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
