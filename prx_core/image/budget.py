"""A per-sample decode time budget, so a slow image is a `decode_timeout` reject, never a stalled unit.

The count limits (`prx_core.image.structure`) and the inflate bound (`prx_core.image.integrity`)
refuse the known CPU bombs before any decoder runs; this budget is the backstop for what they do
not foresee. One `Deadline` starts when `open_image` is called and serves every stage after it:
it is checked on every read Pillow makes from the image bytes (header parsing and the decode
loop, which feeds the decoder 64 KiB at a time), every inflate step of the integrity checks, and
between the stages of a decode (load, orientation, RGB conversion, resize, pHash, encode). What
runs inside one decoder call or one stage (libjpeg's output pass, a Lanczos resize) cannot be
interrupted: the pixel cap and the scan limit bound it, and the check after it refuses the sample
once it has spent its budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

from PIL import Image

from prx_core.image.broken import Broken

DECODE_TIMEOUT = "decode_timeout"
# Generous: a 100 MP PNG decodes, resizes and encodes in a few seconds on one loaded core; only
# pathological inputs reach this. A unit of 10,000 such images still ends (the unit time limit).
DEFAULT_DECODE_SECONDS = 30.0
_ATTRIBUTE = "_prx_deadline"


class DecodeTimeout(Broken):
    """The sample spent its decode budget: `reason` is `decode_timeout`."""

    def __init__(self, message: str) -> None:
        super().__init__(DECODE_TIMEOUT, message)


class Deadline:
    """A budget of `seconds` from now, read on `clock` (`time.monotonic` as found at creation,
    so a test can fake it)."""

    def __init__(self, seconds: float = DEFAULT_DECODE_SECONDS, clock: Callable[[], float] | None = None) -> None:
        self.seconds, self.clock = seconds, clock or time.monotonic
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def check(self, stage: str) -> None:
        """Raise `DecodeTimeout` naming `stage` once the budget is spent."""
        elapsed = self.elapsed()
        if elapsed > self.seconds:
            raise DecodeTimeout(f"decode budget of {self.seconds:g} s spent ({elapsed:.1f} s, at {stage})")


class BudgetedReader:
    """A file object that checks the deadline before every read: Pillow parses headers and feeds
    its decoders through `read`, so a decode that keeps reading stops at the budget."""

    def __init__(self, raw: IO[bytes], deadline: Deadline) -> None:
        self._raw, self._deadline = raw, deadline

    def read(self, size: int = -1) -> bytes:
        self._deadline.check("reading the image")
        return self._raw.read(size)

    def __getattr__(self, name: str) -> Any:  # seek, tell, close, ... of the wrapped object
        return getattr(self._raw, name)


def attach(image: Image.Image, deadline: Deadline) -> None:
    """Carry the sample's deadline on its opened image, for the stages that decode it later."""
    setattr(image, _ATTRIBUTE, deadline)


def deadline_of(image: Image.Image) -> Deadline:
    """The deadline `open_image` attached, or a fresh default one for an image opened elsewhere."""
    found = getattr(image, _ATTRIBUTE, None)
    return found if isinstance(found, Deadline) else Deadline()
