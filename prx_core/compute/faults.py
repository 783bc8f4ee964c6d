"""Named pause points for fault-injection tests (and for operators rehearsing a crash).

With `PRX_PAUSE_AT=<point>` set, the process reaching that point prints a marker line to
stderr and sleeps, so a test can SIGKILL it at exactly that moment. Unset, a point costs one
environment lookup.
"""

from __future__ import annotations

import os
import sys
import time

MARKER = "PRX-PAUSED-AT"


def pause_point(name: str) -> None:
    if os.environ.get("PRX_PAUSE_AT") != name:
        return
    print(f"{MARKER} {name} pid={os.getpid()}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
