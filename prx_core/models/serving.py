"""A minimal OpenAI-compatible chat-completions server over any prx_core `Captioner`.

A development tool (point the `openai` backend at a local model without vLLM) and the server of
the `openai` backend's tests and overhead benchmark. `POST /v1/chat/completions` takes the first
`image_url` data URL of the last user message, captions it with the wrapped captioner, and
answers in the chat-completions format with `usage` (completion tokens: the caption re-tokenized
with the captioner's tokenizer when it has one, an approximation of the generated count;
prompt tokens are reported as 0). The prompt text and sampling in the request are recorded
but not applied: the wrapped captioner's own config decides them. Concurrent requests are
micro-batched into one `caption_batch` call (up to `max_batch` images, gathered for at most
`batch_wait_s` after the first) on one worker thread.

Fault injection (`Faults`, replaceable while serving): a schedule per request arrival index,
then a seeded random fraction, each fault being an HTTP status (429 with `Retry-After`, 500,
503...) or "delay" (sleep `delay_s`, then 504 without generating: a client timeout when
`delay_s` exceeds it).

    python -m prx_core.models.serving --model /path/to/checkpoint --port 8000 [--fail-rate 0.1 --fail 500]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from prx_core.models.caption_base import DECODE_ERROR, Captioner, CaptionerConfig
from prx_core.models.captioning import build_captioner

DELAY = "delay"


@dataclass
class Faults:
    """Which requests fail: `schedule[i]` for the i-th request since these faults were installed
    (None serves it), then a seeded random `rate` of the later ones."""

    schedule: Sequence[int | str | None] = ()
    rate: float = 0.0
    fault: int | str = 500
    delay_s: float = 5.0
    retry_after: float | None = None  # sent with 429s
    seed: int = 0
    _random: random.Random = field(init=False, repr=False)
    _seen: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def pick(self) -> int | str | None:
        index, self._seen = self._seen, self._seen + 1
        if index < len(self.schedule):
            return self.schedule[index]
        return self.fault if self.rate > 0 and self._random.random() < self.rate else None


@dataclass
class ServerStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    served: int = 0
    faults: int = 0
    batches: list[int] = field(default_factory=list)  # images per caption_batch call
    bodies: list[dict[str, Any]] = field(default_factory=list)  # request bodies, when recorded


class CaptionServer:
    """Serves `captioner` on host:port from a background thread; use as a context manager."""

    def __init__(
        self, captioner: Captioner, model_name: str, *, host: str = "127.0.0.1", port: int = 0,
        faults: Faults | None = None, max_batch: int = 8, batch_wait_s: float = 0.005, record_bodies: bool = False,
    ) -> None:
        self.captioner, self.model_name, self.host, self.port = captioner, model_name, host, port
        self.faults = faults or Faults()
        self.max_batch, self.batch_wait_s, self.record_bodies = max_batch, batch_wait_s, record_bodies
        self.stats = ServerStats()
        self.tokenizer = getattr(getattr(captioner, "processor", None), "tokenizer", None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="caption-server-model")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> CaptionServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="caption-server", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError("the caption server did not start") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)
        self._executor.shutdown(wait=True)

    def serve_forever(self) -> None:
        self.start()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._queue: asyncio.Queue[tuple[bytes, asyncio.Future]] = asyncio.Queue()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = runner.addresses[0][1]  # the one bound when port=0
        batcher = asyncio.create_task(self._batcher())
        self._ready.set()
        await self._stop.wait()
        batcher.cancel()
        await runner.cleanup()

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        stats = self.stats  # counters of this request, even if the test swaps them meanwhile
        stats.requests += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            faults = self.faults
            fault = faults.pick()
            if fault == DELAY:
                stats.faults += 1
                await asyncio.sleep(faults.delay_s)
                return error_response(504, "injected delay")
            if fault is not None:
                stats.faults += 1
                retry_after = faults.retry_after if fault == 429 else None
                headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None else {}
                return error_response(int(fault), "injected fault", headers)
            try:
                body = await request.json()
            except ValueError:
                return error_response(400, "the body is not JSON")
            if self.record_bodies:
                stats.bodies.append(body)
            if body.get("model") != self.model_name:
                return error_response(404, f"model {body.get('model')!r} is not served here (serving {self.model_name!r})")
            image = first_image(body)
            if isinstance(image, str):
                return error_response(400, image)
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            await self._queue.put((image, future))
            result, tokens = await future
            if result.error is not None:  # a bad image is the client's fault; a model failure ours
                return error_response(400 if result.error.startswith(DECODE_ERROR) else 500, result.error)
            stats.served += 1
            return web.json_response(self.completion(result.caption, tokens, result.finish_reason or "stop"))
        finally:
            stats.in_flight -= 1

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self._queue.get()]
            if self.batch_wait_s > 0 and self._queue.qsize() < self.max_batch - 1:
                await asyncio.sleep(self.batch_wait_s)  # let requests arriving together share a batch
            while len(items) < self.max_batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            images = [image for image, _ in items]
            self.stats.batches.append(len(images))
            try:
                results = await loop.run_in_executor(self._executor, self._caption, images)
            except Exception as exc:  # a captioner must not raise; answer 500s if it does
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(items, results):
                if not future.done():
                    future.set_result(result)

    def _caption(self, images: list[bytes]) -> list[tuple[Any, int]]:
        """On the model thread (a fast tokenizer must not be used from two threads at once)."""
        results = self.captioner.caption_batch(images, [None] * len(images))
        return [(r, self.count_tokens(r.caption) if r.caption else 0) for r in results]

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def completion(self, caption: str, tokens: int, finish_reason: str = "stop") -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": caption}, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
        }


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    from aiohttp import web

    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error", "code": status}}
    return web.json_response(body, status=status, headers=headers)


def first_image(body: dict[str, Any]) -> bytes | str:
    """The bytes of the first base64 image data URL of the last user message, or an error text."""
    try:
        message = [m for m in body["messages"] if m.get("role") == "user"][-1]
        parts = message["content"] if isinstance(message["content"], list) else []
        urls = [p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"] for p in parts
                if isinstance(p, dict) and p.get("type") == "image_url"]
    except (KeyError, IndexError, TypeError, AttributeError):
        return "expected messages with a user message holding an image_url part"
    if not urls:
        return "the user message holds no image_url part"
    header, _, payload = urls[0].partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64")):
        return "only base64 image data URLs are supported"
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return "the image data URL is not valid base64"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local checkpoint directory (transformers backend)")
    parser.add_argument("--served-name", default="", help="model name clients send (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-pixels", type=int, default=448 * 448)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--fail-rate", type=float, default=0.0, help="fraction of requests answered with --fail")
    parser.add_argument("--fail", default="500", help="HTTP status, or 'delay'")
    parser.add_argument("--delay-s", type=float, default=5.0)
    parser.add_argument("--retry-after", type=float, default=None)
    args = parser.parse_args(argv)
    config = CaptionerConfig("transformers", model=args.model, max_pixels=args.max_pixels,
                             max_new_tokens=args.max_new_tokens, batch_size=args.max_batch)
    fault: int | str = DELAY if args.fail == DELAY else int(args.fail)
    server = CaptionServer(
        build_captioner(config), args.served_name or args.model.rstrip("/").split("/")[-1], host=args.host,
        port=args.port, max_batch=args.max_batch,
        faults=Faults(rate=args.fail_rate, fault=fault, delay_s=args.delay_s, retry_after=args.retry_after),
    )
    print(f"serving {server.model_name!r} at http://{args.host}:{args.port}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
