"""What the trainer reading the corpus will ask of it, so the pipeline can warn before it fails."""

from __future__ import annotations

import dagster as dg
from pydantic import Field


class TrainingResource(dg.ConfigurableResource):
    """The PRX trainer's `per_stream` batching takes whole global batches from one stream, and
    raises on a stream with fewer samples than one batch: `mds_shards` warns about such streams."""

    global_batch_size: int = Field(default=256, gt=0, description="Samples per global batch (all ranks) in training.")
