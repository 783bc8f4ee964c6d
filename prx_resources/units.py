"""How big the work units of the stages are: the trade between resume granularity (a crash redoes
at most one unit per worker), parallelism and fragment size.

Each field is a unit size a stage declares (`Stage.unit_sizes`): its default and its description
come from the declaration, so a new unit size needs one line here and nothing else.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from prx_core.stages.entry import STAGES

FIELDS: dict[str, tuple[str, str]] = {  # resource field -> (stage, its setting)
    "samples_bytes": ("samples", "unit_bytes"),
    "samples_seconds": ("samples", "unit_seconds"),
    "samples_rows": ("samples", "unit_rows"),
    "samples_files": ("samples", "unit_files"),
    "buckets_rows": ("buckets", "unit_rows"),
    "phashes_rows": ("phashes", "unit_rows"),
    "captions_rows": ("captions", "unit_rows"),
    "caption_labels_rows": ("caption_labels", "unit_rows"),
    "caption_embeddings_rows": ("caption_embeddings", "unit_rows"),
    "text_latents_rows": ("text_latents", "unit_rows"),
    "duplicates_rows": ("duplicates", "unit_rows"),
    "duplicates_rows_per_bucket": ("duplicates", "rows_per_bucket"),
    "mds_route_rows": ("mds_shards", "route_rows"),
    "mds_chunk_rows": ("mds_shards", "chunk_rows"),
    "explorer_rows": ("explorer", "unit_rows"),
}


def unit_field(name: str) -> Any:
    """The pydantic field of resource field `name`: the declared default and description, > 0."""
    stage, setting = STAGES[FIELDS[name][0]], FIELDS[name][1]
    described = {u.setting: u.description for u in stage.unit_sizes}
    return Field(default=stage.defaults()[setting], gt=0, description=described[setting])


class UnitsResource(dg.ConfigurableResource):
    """Unit sizes per stage. They shape how work is cut, never what is written: changing one starts
    a new attempt (it is part of the run manifest) and gives the same rows and MDS bytes. A small
    corpus on few cores wants small units (parallelism); PRX scale wants the defaults."""

    samples_bytes: int = unit_field("samples_bytes")
    samples_seconds: float = unit_field("samples_seconds")
    samples_rows: int = unit_field("samples_rows")
    samples_files: int = unit_field("samples_files")
    buckets_rows: int = unit_field("buckets_rows")
    phashes_rows: int = unit_field("phashes_rows")
    captions_rows: int = unit_field("captions_rows")
    caption_labels_rows: int = unit_field("caption_labels_rows")
    caption_embeddings_rows: int = unit_field("caption_embeddings_rows")
    text_latents_rows: int = unit_field("text_latents_rows")
    duplicates_rows: int = unit_field("duplicates_rows")
    duplicates_rows_per_bucket: int = unit_field("duplicates_rows_per_bucket")
    mds_route_rows: int = unit_field("mds_route_rows")
    mds_chunk_rows: int = unit_field("mds_chunk_rows")
    explorer_rows: int = unit_field("explorer_rows")

    def settings(self, stage: str) -> dict[str, Any]:
        """The unit-size settings of `stage`, as its run takes them (`run_stage(..., **settings)`)."""
        return {setting: getattr(self, name) for name, (owner, setting) in FIELDS.items() if owner == stage}
