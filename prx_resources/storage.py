"""Where the corpus lives: a local folder or an s3:// prefix, through one URI-aware layer."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from prx_core.image.buckets import TIERS
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.store.storage import Storage


class StorageResource(dg.ConfigurableResource):
    """The corpus root: Lance tables under `<root>/lance`, MDS under `<root>/mds`, skip-lists under
    `<root>/skiplists`. Local paths and `s3://bucket/prefix` URIs work the same."""

    root: str = Field(description="Local folder or s3://bucket/prefix holding the corpus.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="s3fs options (key, secret, endpoint_url, client_kwargs); translated for Lance.",
    )
    max_tier: int = Field(default=TIERS[-1], description="Largest resolution tier (512, 1024, 2048 or 4096).")
    max_pixels: int = Field(default=DEFAULT_MAX_PIXELS, description="Images above this many pixels are rejected unread.")

    def storage(self) -> Storage:
        return Storage(self.root, dict(self.storage_options))

    def tier_version(self) -> str:
        """Changes bucket geometry: part of the code version of `buckets` and `mds_shards`."""
        return f"tier{self.max_tier}"

    def pixel_cap_version(self) -> str:
        """Changes which images are refused: part of the code version of `samples`."""
        return f"px{self.max_pixels}"
