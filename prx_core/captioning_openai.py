"""The `openai` captioner backend: any OpenAI-compatible chat-completions endpoint.

One request per image (`vllm serve` batches concurrent requests itself): the image, decoded
safely and capped at `max_pixels` like the transformers backend, is re-encoded as a JPEG data URL
and sent with the caption prompt and the config's sampling. Up to `concurrency` requests are in
flight; each attempt has a `timeout_s` deadline; 429, 5xx, timeouts and connection errors are
retried up to `max_retries` times with exponential backoff and full jitter (a `Retry-After`
header is honoured). An image that still fails becomes a `CaptionResult` error, never an
exception, so the captions stage stores it and retries it on the next materialization.

Error reason codes (the part before ": "): `http_error` ("http_error: 500 <body>"), `timeout`,
`connection_error`, `bad_response` (no `choices[0].message.content`), `empty_caption` and
`decode_error:<reason>` (the image never left the machine).
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import io
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

from prx_core.captioning import (
    EMPTY_CAPTION,
    Captioner,
    CaptionerConfig,
    CaptionResult,
    check_lengths,
    prepare_image,
)
from prx_core.prompts import CAPTION_PROMPT

HTTP_ERROR = "http_error"
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
BAD_RESPONSE = "bad_response"
RETRYABLE_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 120.0
JPEG_QUALITY = 90


def encode_for_request(data: bytes, max_pixels: int) -> bytes | CaptionResult:
    """The JPEG actually sent: decoded with prx_core.decode, capped at `max_pixels`, re-encoded."""
    image = prepare_image(data, max_pixels)
    if isinstance(image, CaptionResult):
        return image
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


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


def request_body(config: CaptionerConfig, jpeg: bytes) -> dict[str, Any]:
    return {
        "model": config.model,
        "messages": [{
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(jpeg)}},
                {"type": "text", "text": CAPTION_PROMPT},
            ],
        }],
        "max_tokens": config.max_new_tokens,
        "temperature": float(config.temperature),
        "top_p": float(config.top_p) if config.temperature > 0 else 1.0,
        "n": 1,
        "stream": False,
    }


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


@dataclass
class Attempt:
    """The outcome of one image: its result, the usage the server reported, the attempts made."""

    result: CaptionResult
    usage: dict[str, int] | None
    attempts: int


class OpenAICaptioner(Captioner):
    """Captions through an OpenAI-compatible endpoint; see the module docstring.

    `usage` accumulates over the captioner's life: images, ok, failed, requests, retries, and
    the `prompt_tokens` / `completion_tokens` the server reported (when it did), so output
    tokens/s can be derived by the caller. `last_usage` holds the per-image usage of the last
    `caption_batch` call (aligned with its results; None where unknown or failed).
    """

    def __init__(self, config: CaptionerConfig) -> None:
        super().__init__(config)
        self.url = chat_url(config.endpoint)
        self.headers = auth_headers(config.api_key_env)
        self.usage: Counter[str] = Counter()
        self.last_usage: list[dict[str, int] | None] = []
        self._random = random.Random()

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None]) -> list[CaptionResult]:
        check_lengths(images, original_captions)
        if not images:
            self.last_usage = []
            return []
        outcomes = run_coroutine(self._caption_all(list(images)))
        self.last_usage = [o.usage for o in outcomes]
        for o in outcomes:
            self.usage["images"] += 1
            self.usage["ok" if o.result.error is None else "failed"] += 1
            self.usage["requests"] += o.attempts
            self.usage["retries"] += max(0, o.attempts - 1)
            for key, value in (o.usage or {}).items():
                self.usage[key] += value
        return [replace(o.result, tokens=(o.usage or {}).get("completion_tokens")) if o.result.error is None else o.result
                for o in outcomes]

    async def _caption_all(self, images: list[bytes]) -> list[Attempt]:
        import aiohttp

        semaphore = asyncio.Semaphore(self.config.concurrency)
        connector = aiohttp.TCPConnector(limit=self.config.concurrency)
        async with aiohttp.ClientSession(connector=connector, headers=self.headers) as session:
            return list(await asyncio.gather(*(self._caption_one(session, semaphore, data) for data in images)))

    async def _caption_one(self, session: Any, semaphore: asyncio.Semaphore, data: bytes) -> Attempt:
        jpeg = encode_for_request(data, self.config.max_pixels)  # CPU work, before the first await
        if isinstance(jpeg, CaptionResult):
            return Attempt(jpeg, None, 0)
        payload = json.dumps(request_body(self.config, jpeg)).encode()
        attempts = 0
        while True:
            async with semaphore:  # the wait for a slot is not part of the request's timeout
                attempts += 1
                failure, retryable, wait_hint, outcome = await self._post(session, payload)
            if outcome is not None:
                return Attempt(outcome[0], outcome[1], attempts)
            if not retryable or attempts > self.config.max_retries:
                suffix = f" (after {attempts} attempts)" if attempts > 1 else ""
                return Attempt(CaptionResult.failed(failure[0], failure[1] + suffix), None, attempts)
            await asyncio.sleep(self.backoff(attempts, wait_hint))

    def backoff(self, attempts: int, retry_after: float | None) -> float:
        """Full jitter on an exponential cap; a server's Retry-After is a floor."""
        jitter = self._random.uniform(0, min(MAX_BACKOFF_S, self.config.backoff_s * 2 ** (attempts - 1)))
        return max(jitter, min(retry_after, MAX_RETRY_AFTER_S)) if retry_after is not None else jitter

    async def _post(self, session: Any, payload: bytes):
        """One attempt: (failure, retryable, retry_after, None) or (None, False, None, (result, usage))."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        try:
            async with session.post(self.url, data=payload, timeout=timeout) as response:
                text = await response.text(errors="replace")
                if response.status != 200:
                    hint = retry_after_seconds(response.headers.get("Retry-After"))
                    message = f"{response.status} {' '.join(text.split())[:300]}"
                    return (HTTP_ERROR, message), response.status in RETRYABLE_STATUS, hint, None
        except asyncio.TimeoutError:
            return (TIMEOUT, f"no answer within {self.config.timeout_s:g} s"), True, None, None
        except aiohttp.ClientError as exc:  # refused, reset, disconnected, payload errors
            return (CONNECTION_ERROR, f"{type(exc).__name__}: {exc}"), True, None, None
        return None, False, None, parse_response(text)


def parse_response(text: str) -> tuple[CaptionResult, dict[str, int] | None]:
    """`choices[0].message.content` as the caption, and the integer `usage` counts if present."""
    try:
        body = json.loads(text)
        content = body["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return CaptionResult.failed(BAD_RESPONSE, f"{type(exc).__name__}: {' '.join(text.split())[:200]}"), None
    if isinstance(content, list):  # some servers answer with content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        return CaptionResult.failed(BAD_RESPONSE, f"message content is {type(content).__name__}"), None
    raw = body.get("usage") if isinstance(body, dict) else None
    usage = {k: v for k, v in raw.items() if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int)} \
        if isinstance(raw, dict) else {}
    caption = content.strip()
    result = CaptionResult(caption) if caption else CaptionResult.failed(EMPTY_CAPTION, "the endpoint returned no text")
    return result, usage or None


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

    thread = threading.Thread(target=target, name="openai-captioner")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]

