"""What the trainer reading the corpus will ask of it, so the pipeline can warn (or act) before it fails."""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import Field


class TrainingResource(dg.ConfigurableResource):
    """The PRX trainer's `per_stream` batching takes whole global batches from one stream, and
    raises on a stream with fewer samples than one batch per canonical node: `mds_shards` warns
    about such streams, or with `small_streams: drop` does not publish them, or with `merge` joins
    them across sources into one stream per tier and bucket under `mds/_merged`."""

    global_batch_size: int = Field(default=256, gt=0, description="Samples per global batch (all ranks) in training.")
    canonical_nodes: int = Field(
        default=1, gt=0,
        description="The trainer's num_canonical_nodes: a stream needs global_batch_size x canonical_nodes samples.")
    small_streams: Literal["warn", "drop", "merge"] = Field(
        default="warn",
        description="A stream below global_batch_size x canonical_nodes samples: `warn` (the check "
                    "mds_shards_stream_sizes; the trainer must leave it out), `drop` (mds_shards does not publish it; "
                    "its rows are rejects `small_stream`, so a trainer listing the MDS folders needs no patch) or "
                    "`merge` (published inside one stream per tier and bucket across sources, mds/_merged/<tier>/<w>x<h>, "
                    "which a trainer lists like a source; its samples keep their skip-lists).")

    def stream_minimum(self) -> int:
        return self.global_batch_size * self.canonical_nodes

    def min_stream_samples(self) -> int:
        """What `mds_shards` must not publish alone: the minimum under `drop` and `merge`, else 0 (publish all)."""
        return self.stream_minimum() if self.small_streams != "warn" else 0

    def merge_small(self) -> bool:
        return self.small_streams == "merge"
