"""The `openai` captioner backend: any OpenAI-compatible chat-completions endpoint.

One request per image (`vllm serve` batches concurrent requests itself): the image, decoded
safely and capped at `max_pixels` like the transformers backend, is re-encoded as a JPEG data URL
and sent with the caption prompt and the config's sampling. Transport (bounded concurrency,
per-attempt timeout, retries with backoff on 429/5xx/timeouts/connection errors, Retry-After,
auth) is the shared `prx_core.models.openai_http.ChatClient`. An image that still fails becomes a
`CaptionResult` error, never an exception, so the captions stage stores it and retries it on the
next materialization.

Error reason codes (the part before ": "): `http_error` ("http_error: 500 <body>"), `timeout`,
`connection_error`, `response_too_large` (a body over `max_response_bytes`), `bad_response`
(anything but a completion with text content: parsing never raises, whatever the body holds),
`empty_caption` and `decode_error:<reason>` (the image never left the machine). The caption is
cleaned and capped like every stored caption (prx_core.models.caption_text).
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Sequence

from prx_core.models import openai_http as http
from prx_core.models.caption_base import (
    Captioner,
    CaptionerConfig,
    CaptionResult,
    check_lengths,
    generated_caption,
    prepare_image,
)
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS
from prx_core.models.prompts import CAPTION_PROMPT

HTTP_ERROR = "http_error"
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
BAD_RESPONSE = "bad_response"
RESPONSE_TOO_LARGE = "response_too_large"
JPEG_QUALITY = 90


def encode_for_request(data: bytes, max_pixels: int) -> bytes | CaptionResult:
    """The JPEG actually sent: decoded with prx_core.image.decode, capped at `max_pixels`, re-encoded."""
    image = prepare_image(data, max_pixels)
    if isinstance(image, CaptionResult):
        return image
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def request_body(config: CaptionerConfig, jpeg: bytes, fallback: bool = False) -> dict[str, Any]:
    """The chat-completions body; `fallback`: the retry of a refused caption, with the config's
    fallback temperature and `repetition_penalty` (an extra parameter vLLM, SGLang and TGI accept)."""
    temperature, penalty = config.decoding(fallback)
    body = {
        "model": config.model,
        "messages": [{
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(jpeg)}},
                {"type": "text", "text": CAPTION_PROMPT},
            ],
        }],
        "max_tokens": config.max_new_tokens,
        "temperature": float(temperature),
        "top_p": float(config.top_p) if temperature > 0 else 1.0,
        "n": 1,
        "stream": False,
    }
    if penalty is not None:
        body["repetition_penalty"] = penalty
    if fallback and temperature > 0:
        body["seed"] = 0  # a sampled retry is reproducible where the server honours seeds
    return body


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
        self.client = http.ChatClient(config)
        self.usage: Counter[str] = Counter()
        self.last_usage: list[dict[str, int] | None] = []

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
        check_lengths(images, original_captions)
        outcomes = self.client.gather(list(images), partial(self._caption_one, fallback=fallback))
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

    async def _caption_one(self, data: bytes, post: http.Post, fallback: bool = False) -> Attempt:
        jpeg = encode_for_request(data, self.config.max_pixels)  # CPU work, before the first await
        if isinstance(jpeg, CaptionResult):
            return Attempt(jpeg, None, 0)
        reply = await post(request_body(self.config, jpeg, fallback))
        if reply.text is None:
            return Attempt(caption_failure(reply, self.config.timeout_s), None, reply.attempts)
        result, usage = parse_response(reply.text, self.config.max_caption_chars)
        return Attempt(result, usage, reply.attempts)


def caption_failure(reply: http.Reply, timeout_s: float) -> CaptionResult:
    """A failed `Reply` as this backend's stored error, e.g. "http_error: 500 <body> (after 3 attempts)"."""
    if reply.failure == http.HTTP:
        reason, message = HTTP_ERROR, f"{reply.status} {' '.join(reply.detail.split())[:300]}"
    elif reply.failure == http.TIMEOUT:
        reason, message = TIMEOUT, f"no answer within {timeout_s:g} s"
    elif reply.failure == http.TOO_LARGE:
        reason, message = RESPONSE_TOO_LARGE, reply.detail
    else:
        reason, message = CONNECTION_ERROR, reply.detail
    suffix = f" (after {reply.attempts} attempts)" if reply.attempts > 1 else ""
    return CaptionResult.failed(reason, message + suffix)


def parse_response(text: str, max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS
                   ) -> tuple[CaptionResult, dict[str, int] | None]:
    """`choices[0].message.content` (a string, or content parts with string `text`) as the caption,
    cleaned and capped, with `choices[0].finish_reason` ("length": the token cap stopped it) and
    the integer `usage` counts if present. Never raises: any other body is a `bad_response` result."""
    try:
        content, body = http.parse_chat(text)
        caption = content_text(content)
        if caption is None:
            return CaptionResult.failed(BAD_RESPONSE, f"message content is {describe(content)}"), None
        raw = body.get("usage") if isinstance(body, dict) else None
        usage = {k: v for k, v in raw.items() if k in ("prompt_tokens", "completion_tokens")
                 and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62} if isinstance(raw, dict) else {}
        reason = body["choices"][0].get("finish_reason") if isinstance(body["choices"][0], dict) else None
        reason = reason[:40] if isinstance(reason, str) else None
        return generated_caption(caption, max_caption_chars, empty="the endpoint returned no text",
                                 finish_reason=reason), usage or None
    except http.BAD_SHAPE as exc:
        return CaptionResult.failed(BAD_RESPONSE, f"{exc} in {' '.join(str(text)[:400].split())[:200]}"), None
    except Exception as exc:  # the contract: a result, never an exception, whatever the body holds
        return CaptionResult.failed(BAD_RESPONSE, f"{type(exc).__name__}: {str(exc)[:200]}"), None


def content_text(content: object) -> str | None:
    """The text of `message.content`: a string, or the concatenated string `text` of content
    parts (some servers answer with parts; parts without text are skipped); None otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [part.get("text", "") for part in content if isinstance(part, dict)]
    return "".join(texts) if all(isinstance(t, str) for t in texts) else None


def describe(value: object) -> str:
    """A value's kind for an error message: its type, and for a list, its parts' types."""
    if isinstance(value, list):
        kinds = sorted({type(v.get("text")).__name__ if isinstance(v, dict) else type(v).__name__ for v in value[:100]})
        return f"a list of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__
