"""A sliding window of fetches over a table reader's batches: a slow host cannot sink a unit.

A URL table (and an HF `Image()` column of URL paths) is read in batches of 256 rows. Fetching
each batch to the end before the next one starts makes every batch wait for its slowest URL;
instead a reader's rows enter one window (`FetchWindow`, one event loop thread and one HTTP session
per reader) and their fetches start in row order, `concurrency` at a time, while later batches
keep being read and fetched: a batch is emitted once all its rows are done, and a slow URL holds
only its own row (and, once the window is full, the rows after it), up to its deadline
(`client`). While the window is full or over its bytes, the oldest batch's done rows go out at
once (a prefix: rows stay in order, so a rerun writes the same fragments). What it holds is bounded:

- rows: at most `window_rows` read ahead of the oldest row not emitted;
- bytes: no new fetch starts while the bodies held (done, not yet emitted) and those streaming
  in reach `window_bytes`, so the bytes held are at most `window_bytes` plus what the fetches in
  flight stream (each under `max_image_bytes`);
- time: each URL has its deadline, and with the unit's `deadline` (the unit's time for fetching,
  `samples`) the rows not fetched by then are `not_fetched` rejects: the unit commits what it has.

Object-store keys, `file://` URLs and absolute paths are read in a thread pool of the same size
(`download.read_file`), under the same window. What a fetch may reach is the source's
`policy.FetchPolicy` (refused: `url_not_allowed`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_core.sources.fetch.client import Fetched, HttpClient
from prx_core.sources.fetch.download import describe, is_http, read_file
from prx_core.sources.fetch.policy import FetchPolicy
from prx_core.sources.records import NOT_FETCHED, URL_NOT_ALLOWED

WAKE_S = 0.5  # the consumer looks again at least this often while it waits


@dataclass
class Job:
    """One URL's fetch: its outcome once done (a future set on the window's loop)."""

    url: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    size: int = 0  # bytes held since it finished, until released

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> Fetched:
        return self.future.result()


class FetchWindow:
    """Fetches in submission order, `settings.concurrency` at a time, within a byte budget and an
    optional deadline (wall clock, `time.time()`); use as a context manager."""

    def __init__(self, settings: Any, max_bytes: int, storage_options: dict[str, Any] | None = None,
                 deadline: float | None = None, source_uri: str | None = None) -> None:
        self.settings, self.max_bytes, self.storage_options = settings, max_bytes, storage_options
        self.deadline, self.policy = deadline, FetchPolicy(settings, source_uri)
        self.held = self.streaming = self.queued = 0  # guarded by _changed's lock
        self.finished = 0  # fetches done so far: what a waiting consumer compares
        self.peak = 0  # the most bytes held and streaming at once
        self._changed = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queue: asyncio.Queue | None = None
        self._budget: asyncio.Event | None = None
        self._closed = threading.Event()

    # -- the consumer's side (the reader's thread) ----------------------------------------------------

    def submit(self, urls: list[str]) -> list[Job]:
        jobs = [Job(url) for url in urls]
        if not jobs:
            return jobs
        self._start()
        with self._changed:
            self.queued += len(jobs)
        self._loop.call_soon_threadsafe(self._enqueue, jobs)  # one wake-up of the loop per batch, not per URL
        return jobs

    def _enqueue(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queue.put_nowait(job)

    def release(self, jobs: list[Job]) -> None:
        """The consumer emitted these jobs' rows: their bytes no longer count."""
        with self._changed:
            for job in jobs:
                self.held -= job.size
                job.size = 0
        if jobs and self._loop is not None and not self._closed.is_set():
            self._loop.call_soon_threadsafe(self._budget.set)

    def over_budget(self) -> bool:
        """Fetches wait to start because the bytes held and streaming reach `window_bytes`."""
        with self._changed:
            return self.queued > 0 and self.held + self.streaming >= self.settings.window_bytes

    def wait(self, seen: int, timeout: float = WAKE_S) -> None:
        """Until more than `seen` fetches are done (or `timeout`)."""
        with self._changed:
            self._changed.wait_for(lambda: self.finished > seen, timeout)

    def stream(self, prepared: Iterator[tuple[pa.RecordBatch, Any]],
               finish: Callable[[pa.RecordBatch, Any], pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Each (batch, rows) of `prepared` with its rows' URLs fetched, through `finish`, in order;
        `rows` is a `tables.Rows` (its `urls`, `images`, `refuse`, `live` and `slice`)."""
        pending: deque[_Pending] = deque()
        for batch, rows in prepared:
            wanted = [i for i in rows.live() if rows.images[i] is None and rows.urls[i]]
            pending.append(_Pending(batch, rows, dict(zip(wanted, self.submit([rows.urls[i] for i in wanted])))))
            yield from self._emit(pending, finish, final=False)
        yield from self._emit(pending, finish, final=True)

    def _emit(self, pending: deque[_Pending], finish: Callable[[pa.RecordBatch, Any], pa.RecordBatch],
              final: bool) -> Iterator[pa.RecordBatch]:
        """The done batches at the head; then, until there is room for one more batch (or, `final`,
        until all are out), emit the head's done prefix, or wait."""
        while pending:
            seen, head = self.finished, pending[0]
            if head.complete():
                pending.popleft()
                yield head.take(len(head.batch), self, finish)
                continue
            ahead = sum(len(p.batch) - p.emitted for p in pending)
            if not final and ahead < self.settings.window_rows and not self.over_budget():
                return
            if (upto := head.done_prefix()) > head.emitted:  # rather than wait idle: the oldest batch's done rows
                yield head.take(upto, self, finish)
                continue
            self.wait(seen)

    # -- the window's loop (a thread of its own) ------------------------------------------------------

    def _start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()

        def run() -> None:
            asyncio.run(self._main(ready))

        self._thread = threading.Thread(target=run, name="prx-fetch-window", daemon=True)
        self._thread.start()
        ready.wait()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue, self._budget = asyncio.Queue(), asyncio.Event()
        end = None if self.deadline is None else self._loop.time() + (self.deadline - time.time())
        client = HttpClient(self.settings, self.max_bytes, self.policy)
        files = concurrent.futures.ThreadPoolExecutor(max(1, self.settings.concurrency), "prx-fetch-file")
        slots = asyncio.Semaphore(max(1, self.settings.concurrency))
        tasks: set[asyncio.Task] = set()
        ready.set()
        try:
            while (job := await self._queue.get()) is not None:
                if end is None or self._loop.time() < end:
                    await slots.acquire()
                    if await self._room(end):
                        with self._changed:
                            self.queued -= 1
                        task = asyncio.create_task(self._run(job, client, files, end, slots))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        continue
                    slots.release()
                self._finish(job, Fetched(reason=NOT_FETCHED, cause="the unit's time for fetching ran out before "
                                                                    "this URL's turn"), started=False)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
            files.shutdown(wait=False, cancel_futures=True)

    async def _room(self, end: float | None) -> bool:
        """Wait while the bytes held and streaming reach the budget; False once `end` is past."""
        while True:
            if end is not None and self._loop.time() >= end:
                return False
            with self._changed:
                if self.held + self.streaming < self.settings.window_bytes:
                    return True
            self._budget.clear()
            try:
                await asyncio.wait_for(self._budget.wait(), None if end is None else max(0.0, end - self._loop.time()))
            except TimeoutError:
                return False

    async def _run(self, job: Job, client: HttpClient, files: concurrent.futures.Executor, end: float | None,
                   slots: asyncio.Semaphore) -> None:
        streamed = [0]

        def on_bytes(n: int) -> None:
            streamed[0] += n
            with self._changed:
                self.streaming += n
                self.peak = max(self.peak, self.held + self.streaming)

        try:
            if (refusal := self.policy.refusal(job.url)) is not None:
                outcome = Fetched(reason=URL_NOT_ALLOWED, cause=refusal)
            elif is_http(job.url):
                outcome = await client.fetch(job.url, end, on_bytes)
            else:
                read = self._loop.run_in_executor(files, read_file, job.url, self.storage_options, self.max_bytes)
                timeout = None if end is None else max(0.0, end - self._loop.time())
                try:
                    outcome = await asyncio.wait_for(read, timeout)
                except TimeoutError:
                    outcome = Fetched(reason=NOT_FETCHED, cause="the unit's time for fetching ran out while reading")
        except Exception as exc:  # never a unit's failure: this row's cause
            outcome = Fetched(reason="download_error", cause=f"{type(exc).__name__}: {exc}"[:160])
        finally:
            slots.release()
            with self._changed:
                self.streaming -= streamed[0]
        self._finish(job, outcome, started=True)

    def _finish(self, job: Job, outcome: Fetched, started: bool) -> None:
        with self._changed:
            if not started:
                self.queued -= 1
            job.size = len(outcome.data or b"")
            self.held += job.size
            self.finished += 1
            job.future.set_result(outcome)
            self._changed.notify_all()
        self._budget.set()

    # -- lifetime ------------------------------------------------------------------------------------

    def __enter__(self) -> FetchWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._thread is None or self._closed.is_set():
            return
        self._closed.set()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
        self._thread.join(timeout=30)


def fetch_http(urls: list[str], settings: Any, max_bytes: int) -> list[Fetched]:
    """Fetch `urls` (http or https) with `settings` (`DownloadSettings`), in order, through a window
    of its own (its event loop runs in a thread of its own: callable from an async Ray actor too).
    The caller holds every body it returns: the window's byte budget counts only those not taken yet."""
    out = []
    with FetchWindow(settings, max_bytes) as window:
        for job in window.submit(urls):
            out.append(job.wait())
            window.release([job])
    return out


@dataclass
class _Pending:
    """One batch in the window: its rows, its rows' fetches by row index, how many rows went out."""

    batch: pa.RecordBatch
    rows: Any
    jobs: dict[int, Job]
    emitted: int = 0

    def complete(self) -> bool:
        return all(job.done() for job in self.jobs.values())

    def done_prefix(self) -> int:
        """The first row at or after `emitted` whose fetch is not done (or the batch's length)."""
        for i in range(self.emitted, len(self.batch)):
            job = self.jobs.get(i)
            if job is not None and not job.done():
                return i
        return len(self.batch)

    def take(self, upto: int, window: FetchWindow, finish: Callable[[pa.RecordBatch, Any], pa.RecordBatch]
             ) -> pa.RecordBatch:
        """Rows `emitted`..`upto` with their fetched bytes (or rejects), through `finish`."""
        start, count = self.emitted, upto - self.emitted
        taken = []
        for i in range(start, upto):
            job = self.jobs.pop(i, None)
            if job is None:
                continue
            outcome = job.wait()
            if outcome.reason is None:
                self.rows.images[i] = outcome.data
            else:
                self.rows.refuse(i, outcome.reason, describe(outcome.cause, self.rows.urls[i]))
            taken.append(job)
        window.release(taken)
        self.emitted = upto
        out = finish(self.batch.slice(start, count), self.rows.slice(start, count))
        for i in range(start, upto):
            self.rows.images[i] = None  # the batch holds its copy; the window's account is released
        return out

