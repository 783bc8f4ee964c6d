"""The `mds_shards` settings (`MdsSettings`, read by the stage's steps and its units alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prx_core.image.buckets import TIERS
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.stages.settings import Settings

ROUTE_ROWS = 1_000_000  # samples per routing unit, a range of content ids: sizes, ids and captions, no pixels
CHUNK_ROWS = 50_000  # target rows per MDS chunk: one worker task, one sub-folder of a stream


@dataclass(frozen=True, kw_only=True)
class MdsSettings(Settings):
    """The `mds_shards` settings: whose captions, the tier and pixel caps, the unit sizes, what becomes
    of streams below `min_stream_samples`, and the text latents the chunks carry."""

    captioner_version: str
    max_tier: int = TIERS[-1]
    max_pixels: int = DEFAULT_MAX_PIXELS
    route_rows: int = ROUTE_ROWS
    chunk_rows: int = CHUNK_ROWS
    min_stream_samples: int = 0
    merge_small: bool = False  # below min_stream_samples: merged into `_merged` (True) or dropped
    # {preset, encoder_version, masks, max_tokens} when text_latents is configured
    latents: dict[str, Any] | None = None
