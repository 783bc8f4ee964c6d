"""The live progress display of `prx-corpus build` in a terminal.

Every stage reports progress as log lines (`prx_core.compute.parallel.Throttle`, every 5 s and at
the end): `samples[photos]: 12/40 units, 120,000/400,000 rows, 3,100 rows/s, ETA 1m30s`, also from
a Ray job through Dagster Pipes. In a terminal the build's console logger (`build_console`) turns
them into one status line at the bottom, redrawn in place with a bar (`LiveStatus`), while every
other line (Dagster's log, the build's own `==>` lines) prints above it; a stage's last report
(done = total) stays as a plain line. Not a terminal (a CI log, a pipe): the lines as they are.
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Any, TextIO

LINE = re.compile(r"^(?P<label>.+?): (?P<done>\d+)/(?P<total>\d+) (?P<unit>[A-Za-z_]+)(?:, (?P<rest>.*))?$")
BAR = 24


@dataclass(frozen=True)
class StageProgress:
    """One parsed progress line."""

    label: str
    done: int
    total: int
    unit: str
    rest: str  # rows, rate and ETA, as the stage wrote them

    @property
    def finished(self) -> bool:
        return self.done >= self.total


def parse_progress(message: str) -> StageProgress | None:
    """A `Throttle` line, or None for any other message."""
    found = LINE.match(message.strip())
    if found is None:
        return None
    return StageProgress(found["label"], int(found["done"]), int(found["total"]), found["unit"], found["rest"] or "")


def render(progress: StageProgress, width: int) -> str:
    """`samples[photos] [#######.........] 12/40 units · 3,100 rows/s, ETA 1m30s`, cut to `width`."""
    filled = round(BAR * progress.done / progress.total) if progress.total else BAR
    text = (f"{progress.label} [{'#' * filled}{'.' * (BAR - filled)}] {progress.done}/{progress.total} "
            f"{progress.unit}" + (f" · {progress.rest}" if progress.rest else ""))
    return text if len(text) < width else text[:max(0, width - 4)] + "..."


class LiveStatus:
    """One status line at the bottom of a terminal; anything else printed goes above it."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.current: StageProgress | None = None
        self.shown = False
        self.lock = threading.RLock()

    def update(self, progress: StageProgress) -> None:
        with self.lock:
            if progress.finished:  # kept in the scrollback as the plain line
                self.current = None
                self.clear()
                self.stream.write(f"{progress.label}: {progress.done}/{progress.total} {progress.unit}"
                                  + (f", {progress.rest}" if progress.rest else "") + "\n")
                self.stream.flush()
                return
            self.current = progress
            self.redraw()

    def clear(self) -> None:
        with self.lock:
            if self.shown:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
                self.shown = False

    def redraw(self) -> None:
        with self.lock:
            if self.current is None:
                return
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r\x1b[2K" + render(self.current, width))
            self.stream.flush()
            self.shown = True

    def echo(self, *args: Any, **kwargs: Any) -> None:
        """`print` for the build's own lines: above the status line."""
        with self.lock:
            self.clear()
            print(*args, **kwargs)
            sys.stdout.flush()
            self.redraw()


STATUS = LiveStatus()


def live() -> bool:
    """Whether the build runs in a terminal (its log stream is one)."""
    return STATUS.stream.isatty()
