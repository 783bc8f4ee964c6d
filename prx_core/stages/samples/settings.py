"""The `samples` settings (`SamplesSettings`, read by the stage's steps and its ingest units alike)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prx_core.compute.units import UNIT_SECONDS
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.units import UNIT_BYTES, UNIT_FILES, UNIT_ROWS
from prx_core.stages.settings import Settings

MAX_DUPLICATE_RATE = 0.001  # repeated sample_ids moved to rejects at most (the asset passes its check's threshold)


@dataclass(frozen=True, kw_only=True)
class SamplesSettings(Settings):
    """The ingest's settings: the source, the decode and caption caps, the unit sizes, and two checks
    after the commit (an empty source refused unless `allow_empty`; `max_duplicate_rate`)."""

    spec: SourceSpec
    max_pixels: int = DEFAULT_MAX_PIXELS
    unit_bytes: int = UNIT_BYTES
    unit_rows: int = UNIT_ROWS
    unit_files: int = UNIT_FILES
    max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS
    unit_seconds: float = UNIT_SECONDS
    allow_empty: bool = False
    max_duplicate_rate: float = MAX_DUPLICATE_RATE

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SamplesSettings:
        """`pin_source` pins the spec as its dict (what the workers read): rebuilt here."""
        return super().from_params({**params, "spec": SourceSpec.from_dict(params["spec"])})
