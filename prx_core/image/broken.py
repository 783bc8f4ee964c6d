"""`Broken`, the refusal every check below the decoder raises, with its reason codes.

It lives below `integrity` (container checks), `structure` (count limits) and `budget` (the decode
deadline) because all three raise it and `integrity` reads the deadline: with `Broken` in
`integrity`, `budget` and `integrity` imported each other.
"""

from __future__ import annotations

TRUNCATED = "truncated"
CORRUPT = "corrupt_image"


class Broken(ValueError):
    """A container that fails its own integrity rules: `reason` is `truncated` or `corrupt_image`
    (or a subclass's own code, such as `decode_timeout`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
