"""How long a client should wait before asking a server again: what both HTTP clients of the
pipeline (model endpoints, image downloads) read from a 429 or 503."""

from __future__ import annotations

import email.utils
import time


def retry_after_seconds(value: str | None) -> float | None:
    """`Retry-After` as delta-seconds or an HTTP date; None when absent or unreadable."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when.timestamp() - time.time())
