"""What one explorer may read at once: at most MAX_SCANS requests scan Lance together.

A search, a page of a duplicate group or "more like this" reads the corpus tables; on a corpus of
a billion rows a few of them at once can hold every core and the memory of the host. Past
MAX_SCANS, a request waits up to SCAN_WAIT_S for a slot, then is refused with 503 and
`Retry-After` (`Busy`, which the thumbnail renders raise too) instead of queueing without bound
behind the others.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

MAX_SCANS = 4
SCAN_WAIT_S = 10.0
RETRY_AFTER = "2"  # seconds, on a 503
BUSY_MESSAGE = "the explorer is busy with other searches: retry in a few seconds"


class Busy(Exception):
    """A bounded resource (scan slots, thumbnail renders) stayed taken: a 503 with Retry-After."""


class ScanSlots:
    """A bounded number of concurrent scans; `slot()` holds one for a request's reads."""

    def __init__(self, slots: int = MAX_SCANS, wait_s: float = SCAN_WAIT_S) -> None:
        self.slots, self.wait_s = slots, wait_s
        self._free = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()
        self.running = 0
        self.refused = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        if not self._free.acquire(timeout=self.wait_s):
            with self._lock:
                self.refused += 1
            raise Busy(BUSY_MESSAGE)
        with self._lock:
            self.running += 1
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1
            self._free.release()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"slots": self.slots, "running": self.running, "refused": self.refused}
