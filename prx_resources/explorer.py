"""The web explorer over the corpus tables: where it is served, so materializations can link to it."""

from __future__ import annotations

from urllib.parse import urlencode

import dagster as dg
from pydantic import Field, field_validator

from prx_core.store.credentials import refuse_literal_secrets


class ExplorerResource(dg.ConfigurableResource):
    """Unset (the default), no links are added; set, materializations carry an `explorer` URL metadata
    entry opening the explorer on what they wrote (their source, filtered where that says more)."""

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

    def source_url(self, source: str | None, **filters: str) -> str | None:
        """The explorer filtered on one source (None: every source) and on the explorer's other filters
        (`skipped="yes"`, `rejected="yes"`, `tier="1024"`...), or None when no explorer is configured."""
        if not self.base_url:
            return None
        query = urlencode({k: v for k, v in {"source": source, **filters}.items() if v})
        return f"{self.base_url}/?{query}" if query else f"{self.base_url}/"

    def metadata(self, source: str | None, **filters: str) -> dict[str, dg.MetadataValue]:
        """`{"explorer": url}` for a materialization (a UrlMetadataValue: a link in the UI), or nothing when unset."""
        url = self.source_url(source, **filters)
        return {"explorer": dg.MetadataValue.url(url)} if url else {}
