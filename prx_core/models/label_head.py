"""The `minilm` labeller's classifier head: a softmax regression over the MiniLM caption embedding.

Why a head and not only label descriptions: cosine similarity to a few descriptions held on the
captions it was calibrated with, but on long VLM paragraphs written independently every class sat
near a threshold (menus, maps, screenshots and infographics went visual; explicit drawings and a
topless photo went visual). A linear head trained on hand-labelled captions
(`data/labelled_captions.jsonl`, train split; `scripts/train_label_head.py`) reads the whole
embedding instead of its angle to a dozen sentences; docs/benchmarks.md has the numbers on the
held-out split.

The head is a small JSON file shipped with the package (`data/label_head.json`): per label a
weight vector over the 384 embedding dimensions and a bias, the decision thresholds chosen by
cross-validation on the training split, and the embedding model it was trained on (a head only
means something for that model: another one is refused, not silently used). Its digest (weights,
bias and labels) enters the labeller version, so retraining it re-labels the corpus.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
HEAD_PATH = DATA / "label_head.json"
LABELLED_PATH = DATA / "labelled_captions.jsonl"
FORMAT = 1
# Kinds of the labelled set that are photos showing some text (a sign, a bib, a plate, an overlaid
# caption): the ones a labeller must not send to `text`.
PHOTO_WITH_TEXT = ("incidental_text", "short_incidental", "overlay_text")


@dataclass(frozen=True)
class LabelHead:
    """Softmax regression: p = softmax(W x + b) for a unit-norm embedding x."""

    labels: tuple[str, ...]
    weights: np.ndarray = field(repr=False)  # (labels, dim)
    bias: np.ndarray = field(repr=False)  # (labels,)
    text_threshold: float
    nsfw_threshold: float
    model: str  # embeddings.model_identity() of the model it was trained on
    meta: dict[str, Any] = field(default_factory=dict, repr=False, hash=False)  # training record, not used to label

    def probabilities(self, vectors: np.ndarray) -> np.ndarray:
        """(N, labels) probabilities, rows summing to 1, for (N, dim) embeddings."""
        logits = np.asarray(vectors, dtype=np.float64) @ self.weights.T + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        odds = np.exp(logits)
        return odds / odds.sum(axis=1, keepdims=True)

    def digest(self) -> str:
        """SHA-256 of what decides the probabilities: labels, weights and bias, exactly."""
        payload = {"labels": list(self.labels), "weights": self.weights.tolist(), "bias": self.bias.tolist()}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "labels": list(self.labels), "model": self.model,
                "text_threshold": self.text_threshold, "nsfw_threshold": self.nsfw_threshold, **self.meta,
                "bias": self.bias.tolist(), "weights": self.weights.tolist()}


def head_from_json(data: dict[str, Any]) -> LabelHead:
    if data.get("format") != FORMAT:
        raise ValueError(f"label head format {data.get('format')!r}, expected {FORMAT}")
    labels = tuple(data["labels"])
    weights = np.asarray(data["weights"], dtype=np.float64)
    bias = np.asarray(data["bias"], dtype=np.float64)
    if weights.ndim != 2 or weights.shape[0] != len(labels) or bias.shape != (len(labels),):
        raise ValueError(f"label head shapes: weights {weights.shape}, bias {bias.shape} for {len(labels)} labels")
    known = {"format", "labels", "model", "text_threshold", "nsfw_threshold", "bias", "weights"}
    return LabelHead(labels, weights, bias, float(data["text_threshold"]), float(data["nsfw_threshold"]),
                     str(data["model"]), {k: v for k, v in data.items() if k not in known})


@functools.cache
def load_head(path: Path = HEAD_PATH) -> LabelHead:
    """The shipped head, read once per process."""
    return head_from_json(json.loads(Path(path).read_text()))


def write_head(head: LabelHead, path: Path = HEAD_PATH) -> None:
    Path(path).write_text(json.dumps(head.to_json(), indent=1) + "\n")


def labelled_rows(path: Path = LABELLED_PATH, split: str | None = None) -> list[dict[str, Any]]:
    """The shipped labelled captions (caption, label, kind, split), optionally one split."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r.get("split") == split]


def rows_digest(rows: Sequence[dict[str, Any]]) -> str:
    """SHA-256 of (caption, label) pairs in order: what a head was trained on."""
    return hashlib.sha256(json.dumps([[r["caption"], r["label"]] for r in rows]).encode()).hexdigest()
