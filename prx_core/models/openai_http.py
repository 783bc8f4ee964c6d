"""One HTTP client for OpenAI-compatible `/chat/completions` endpoints (`vllm serve`, hosted).

Shared by the `openai` captioner (prx_core.models.captioning_openai) and the `llm` labeller over HTTP
(prx_core.models.labels_llm) so that both get the same transport guarantees from one place:
  * at most `concurrency` requests in flight; a slot is held for one attempt, not while
    backing off, so a throttled request does not idle a slot others could use;
  * a `timeout_s` deadline per attempt (the wait for a slot is not part of it);
  * 408, 409, 429, 5xx, timeouts and connection errors retried up to `max_retries` times with
    exponential backoff and full jitter (first cap `backoff_s`, capped at 30 s); a
    `Retry-After` header (seconds or an HTTP date, capped at 120 s) is a floor;
  * `Authorization: Bearer <key>` from the environment variable NAMED in the config.

The client never raises for a failed request: each one ends as a `Reply`, the body of a 200 or
what went wrong on the last attempt, and each backend maps that to its own stored error codes.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

RETRYABLE_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 120.0
HTTP, TIMEOUT, CONNECTION = "http", "timeout", "connection"  # Reply.failure
BAD_SHAPE = (ValueError, KeyError, IndexError, TypeError)  # what `parse_chat` raises on a non-completion

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


@dataclass(frozen=True)
class Reply:
    """How one request ended: `text` is the body of a 200, else `failure` says why."""

    text: str | None
    attempts: int
    failure: str = ""  # HTTP | TIMEOUT | CONNECTION when text is None
    status: int | None = None  # HTTP: the last status
    detail: str = ""  # HTTP: the response body as received; CONNECTION: "<exception type>: <message>"


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


def chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/chat/completions") else base + "/chat/completions"


def retry_after_seconds(value: str | None) -> float | None:
    """`Retry-After` as delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def parse_chat(text: str) -> tuple[Any, Any]:
    """(`choices[0].message.content`, the decoded body) of a 200; raises one of BAD_SHAPE otherwise."""
    body = json.loads(text)
    return body["choices"][0]["message"]["content"], body


class ChatClient:
    """Posts chat-completions bodies with the bounds and retries of the module docstring."""

    def __init__(self, transport: Transport) -> None:
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
            async with session.post(self.url, data=payload, timeout=timeout) as response:
                text = await response.text(errors="replace")
                if response.status == 200:
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
