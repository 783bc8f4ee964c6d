"""Counting what a SIGKILLed driver's attempt recorded, for resume trials and crash tests."""

from __future__ import annotations

import time
from pathlib import Path


def settled_counts(attempt: Path, prefix: str, limit: float = 300.0) -> tuple[int, int]:
    """(units started, units recorded) of an attempt once the killed driver's in-flight units are over.

    On a standing cluster, tasks already dispatched may run on after their driver died and record
    their units late, more so on a loaded machine; so the counts are read once they have not moved
    for twice the longest unit seen (its started -> done interval), at least 3 s.
    """
    def marks(folder: str, suffix: str = "") -> dict[str, float]:
        # pathlib's glob matches dot files: the hidden temp file of a record whose writer was killed
        # mid-write (`put_atomic`) is no record, and the rerun rightly does not count it
        path = attempt / folder
        return {p.name.removesuffix(suffix): p.stat().st_mtime for p in path.glob(f"{prefix}*")
                if not p.name.startswith(".")} if path.is_dir() else {}

    deadline, last, quiet_since = time.monotonic() + limit, None, time.monotonic()
    while True:
        started, done = marks("started"), marks("done", ".json")
        counts = (len(started.keys() | done.keys()), len(done))
        longest = max((t - started[u] for u, t in done.items() if u in started), default=0.0)
        if counts != last:
            last, quiet_since = counts, time.monotonic()
        elif time.monotonic() - quiet_since >= max(3.0, 2 * longest) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)
