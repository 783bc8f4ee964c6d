"""Leaving a process that used Arrow, Lance and Ray without interpreter finalization.

Arrow and Lance keep IO and CPU thread pools; a read still finishing on one of them when Python
finalizes takes the GIL, and the thread's forced unwind aborts the process (SIGABRT, seen after a
build that had printed "ok"). Entry points whose work is done and committed exit here instead.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush what this process printed and logged, then end it with `code`, skipping finalization."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)
