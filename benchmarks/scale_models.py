"""Stand-in models for the scale benchmark: the output columns of LabelBatch and EmbedBatch at
a fixed cost per caption, so the benchmark measures the orchestration around a model (lookups,
reads, writes, commits, actor start-up) rather than MiniLM on a CPU (46 captions/s here)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prx_core.models.embeddings import EmbedderConfig
from prx_core.models.label_base import LabelerConfig


class StandInLabels:
    """Every caption `visual` with score 1.0, after `seconds` per caption."""

    def __init__(self, config: LabelerConfig, seconds: float) -> None:
        self.labeler_id, self.labeler_version, self.seconds = config.labeler_id(), config.version(), seconds

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, np.ndarray]:
        n = len(batch["content_id"])
        time.sleep(self.seconds * n)
        return {"content_id": np.asarray(batch["content_id"], dtype=object), "label": np.full(n, "visual", dtype=object),
                "score": np.ones(n, np.float32), "labeler_id": np.full(n, self.labeler_id, dtype=object),
                "labeler_version": np.full(n, self.labeler_version, dtype=object)}


class StandInEmbeddings:
    """A unit vector per caption drawn from the caption's hash, after `seconds` per caption."""

    def __init__(self, config: EmbedderConfig, seconds: float) -> None:
        self.config, self.seconds = config, seconds
        self.embedder_id, self.embedder_version = config.embedder_id(), config.version()

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, np.ndarray]:
        n = len(batch["content_id"])
        time.sleep(self.seconds * n)
        vectors = np.stack([np.random.default_rng(abs(hash(str(c))) % (1 << 32)).standard_normal(self.config.dim)
                            for c in batch["caption"]]).astype(np.float32) if n else np.zeros((0, self.config.dim), np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True) if n else 1.0
        return {"content_id": np.asarray(batch["content_id"], dtype=object), "embedding": vectors,
                "embedder_id": np.full(n, self.embedder_id, dtype=object),
                "embedder_version": np.full(n, self.embedder_version, dtype=object)}
