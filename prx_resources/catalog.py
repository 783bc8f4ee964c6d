"""The source catalog (`sources.yaml`): partition keys and how to read each source."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from prx_core.sources.catalog import Catalog, SourceSpec, load_catalog


class CatalogResource(dg.ConfigurableResource):
    """Reads the catalog on every use, so an edited `sources.yaml` is seen without a reload."""

    path: str = Field(description="Path of the sources.yaml catalog.")

    def load(self) -> Catalog:
        return load_catalog(self.path)

    def source(self, name: str) -> SourceSpec:
        return self.load().get(name)
