"""Ctrl-C during a build: seeing it whoever handles it, and what the rerun will resume.

A build runs its materializations one after another in its own process; while one runs, Dagster
replaces the SIGINT handler with its own (which turns the signal into an interrupted step, or
just a flag between steps, forgotten when the run ends). `SigintWatch` sees every SIGINT anyway,
through the signal wakeup fd that CPython writes each caught signal's number to, so the build
can stop after the run it was in instead of starting the next. `recorded_units` counts what the
interrupted attempts left under `<root>/_runs`: each recorded unit is skipped by the rerun.
`restore_interrupt_signals` undoes what a background start inherits (SIGINT ignored).
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any

from prx_core.compute.units import COMMITTED, RUNS
from prx_core.store.storage import Storage


class SigintWatch:
    """A context manager: `seen()` says whether a SIGINT arrived since it was entered. Outside the
    main thread (where signals are not delivered to Python) it sees nothing."""

    def __init__(self) -> None:
        self._seen = False
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._previous = -1

    def __enter__(self) -> SigintWatch:
        if threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            self._pair = (reader, writer)
            self._previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        return self

    def seen(self) -> bool:
        if self._pair is not None and not self._seen:
            try:
                while data := self._pair[0].recv(4096):
                    self._seen = self._seen or signal.SIGINT in data
            except BlockingIOError:
                pass
        return self._seen

    def note(self) -> None:
        """A SIGINT seen some other way (a KeyboardInterrupt the caller caught)."""
        self._seen = True

    def __exit__(self, *exc: Any) -> None:
        if self._pair is not None:
            self.seen()
            signal.set_wakeup_fd(self._previous)
            for end in self._pair:
                end.close()
            self._pair = None


def recorded_units(storage: Storage) -> int:
    """Units recorded by attempts not committed yet, over every asset and partition: what a rerun
    of the same materializations skips. One listing per attempt, never a read of a unit."""
    fs = storage.filesystem()
    base = storage.uri(RUNS)
    fs.invalidate_cache()
    if not fs.exists(base):
        return 0
    count = 0
    for asset in fs.ls(base, detail=False):
        for partition in fs.ls(asset, detail=False):
            for attempt in fs.ls(partition, detail=False):
                if not fs.isdir(attempt) or fs.exists(f"{attempt.rstrip('/')}/{COMMITTED}"):
                    continue
                done = f"{attempt.rstrip('/')}/done"
                count += sum(p.endswith(".json") for p in fs.ls(done, detail=False)) if fs.exists(done) else 0
    return count


def restore_interrupt_signals() -> None:
    """A command a non-interactive shell starts in the background (`prx-corpus build &` in a script,
    `make test`'s halves) inherits SIGINT ignored. While a run executes, Dagster copies SIGINT's
    handler onto SIGTERM, so the `tail -F` processes that mirror the run's compute logs start ignoring
    SIGTERM: Dagster's cleanup then waits 30 s for each of them and leaves them running. Python's
    own handlers back: Ctrl-C stops a build however it was started."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
