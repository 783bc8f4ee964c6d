"""The web explorer over the corpus tables: where it is served, so materializations can link to it."""

from __future__ import annotations

import dagster as dg
from pydantic import Field, field_validator

from prx_core.store.credentials import refuse_literal_secrets


class ExplorerResource(dg.ConfigurableResource):
    """Unset (the default), no links are added; set, `samples` and `captions` materializations
    carry an `explorer` URL metadata entry opening the explorer on their source."""

    base_url: str | None = Field(default=None, description="Explorer root URL, e.g. http://explorer.internal:8080.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if not value:  # "" in YAML: unset
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"explorer base_url must start with http:// or https://, got {value!r}")
        refuse_literal_secrets({"base_url": value}, "explorer")  # it enters every samples/captions metadata
        return value.rstrip("/")

    def source_url(self, source: str) -> str | None:
        """The explorer filtered on one source, or None when no explorer is configured."""
        return f"{self.base_url}/?source={source}" if self.base_url else None

    def metadata(self, source: str) -> dict[str, dg.MetadataValue]:
        """`{"explorer": url}` for a materialization, or nothing when unset."""
        url = self.source_url(source)
        return {"explorer": dg.MetadataValue.url(url)} if url else {}
