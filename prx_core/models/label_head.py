"""The `minilm` labeller's classifier head: a softmax regression over the MiniLM caption embedding
and the caption's words.

Why a head and not only label descriptions: cosine similarity to a few descriptions held on the
captions it was calibrated with, but on long VLM paragraphs written independently every class sat
near a threshold (menus, maps, screenshots and infographics went visual; explicit drawings and a
topless photo went visual). A linear head trained on hand-labelled captions
(`data/labelled_captions.jsonl`, train split; `scripts/train_label_head.py`) reads the whole
embedding instead of its angle to a dozen sentences; docs/benchmarks.md has the numbers on the
held-out split.

Why words too (format 2): MiniLM pools a short caption into one vector where a rare word barely
moves it, and the embedding-only head sent short photos of an architect at a drafting table or a
dog's engraved collar tag to `text`, and art nudes, lingerie and a bikini to `nsfw`; a caption's
words ("sketch", "statue", "bikini", "diagram", "screenshot") tell those kinds apart. The head reads
both: x = [embedding, word_scale * w / |w|], w the 0/1 indicators of the vocabulary's words in the
caption (prx_core.models.caption_text.words, the words the caption checks count too; the
vocabulary: words of at least MIN_DF training captions), so the words' part has the embedding's
length times word_scale whatever the caption's length. A word outside the vocabulary adds
nothing; a caption with none is read by its embedding. word_scale (0: embedding only, as format 1)
is chosen with the penalty and thresholds by cross-validation on the training split
(prx_core.models.label_head_train).

The head is a small JSON file shipped with the package (`data/label_head.json`): per label a
weight vector over the 384 embedding dimensions and the vocabulary, a bias, the vocabulary and
word_scale, the decision thresholds chosen by cross-validation on the training split, and the
embedding model it was trained on (a head only means something for that model: another one is
refused, not silently used). Its digest (weights, bias, labels, vocabulary, word_scale) enters the
labeller version, so retraining it re-labels the corpus.
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

from prx_core.models.caption_text import WORD_PATTERN, words

DATA = Path(__file__).resolve().parent / "data"
HEAD_PATH = DATA / "label_head.json"
LABELLED_PATH = DATA / "labelled_captions.jsonl"
FORMAT = 2  # 1: embedding only (no vocabulary), still read
# Kinds of the labelled set that are photos showing some text (a sign, a bib, a plate, an overlaid
# caption): the ones a labeller must not send to `text`.
PHOTO_WITH_TEXT = ("incidental_text", "short_incidental", "overlay_text")


def caption_words(caption: str) -> set[str]:
    """The distinct words of a caption as the head reads them: caption_text.words, the caption
    checks' words too."""
    return set(words(caption))


def word_features(captions: Sequence[str], vocabulary: Sequence[str], scale: float) -> np.ndarray:
    """(N, len(vocabulary)): each caption's 0/1 word indicators scaled to length `scale` (0 without any)."""
    index = {word: i for i, word in enumerate(vocabulary)}
    out = np.zeros((len(captions), len(vocabulary)))
    for row, caption in enumerate(captions):
        hits = [index[w] for w in caption_words(caption) if w in index]
        if hits:
            out[row, hits] = scale / np.sqrt(len(hits))
    return out


@dataclass(frozen=True)
class LabelHead:
    """Softmax regression: p = softmax(W x + b), x the unit-norm embedding followed by the
    caption's scaled word indicators (none when the vocabulary is empty)."""

    labels: tuple[str, ...]
    weights: np.ndarray = field(repr=False)  # (labels, dim + len(vocabulary))
    bias: np.ndarray = field(repr=False)  # (labels,)
    text_threshold: float
    nsfw_threshold: float
    model: str  # embeddings.model_identity() of the model it was trained on
    vocabulary: tuple[str, ...] = field(default=(), repr=False)
    word_scale: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict, repr=False, hash=False)  # training record, not used to label

    def features(self, vectors: np.ndarray, captions: Sequence[str] | None = None) -> np.ndarray:
        """What the weights multiply: the embeddings, and the captions' words when the head has a vocabulary."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if not self.vocabulary:
            return vectors
        if captions is None or len(captions) != len(vectors):
            raise ValueError("this head reads the captions' words: pass the captions with their embeddings")
        return np.hstack([vectors, word_features(captions, self.vocabulary, self.word_scale)])

    def probabilities(self, vectors: np.ndarray, captions: Sequence[str] | None = None) -> np.ndarray:
        """(N, labels) probabilities, rows summing to 1, for (N, dim) embeddings of N captions."""
        logits = self.features(vectors, captions) @ self.weights.T + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        odds = np.exp(logits)
        return odds / odds.sum(axis=1, keepdims=True)

    def digest(self) -> str:
        """SHA-256 of what decides the probabilities: labels, weights and bias, exactly, and the
        vocabulary, word scale and word pattern of a head that reads words."""
        payload: dict[str, Any] = {"labels": list(self.labels), "weights": self.weights.tolist(),
                                   "bias": self.bias.tolist()}
        if self.vocabulary:
            payload.update(vocabulary=list(self.vocabulary), word_scale=self.word_scale, word_pattern=WORD_PATTERN)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "labels": list(self.labels), "model": self.model,
                "text_threshold": self.text_threshold, "nsfw_threshold": self.nsfw_threshold, **self.meta,
                "word_scale": self.word_scale, "vocabulary": list(self.vocabulary),
                "bias": self.bias.tolist(), "weights": self.weights.tolist()}


def head_from_json(data: dict[str, Any]) -> LabelHead:
    if data.get("format") not in (1, FORMAT):
        raise ValueError(f"label head format {data.get('format')!r}, expected {FORMAT} (or 1)")
    labels = tuple(data["labels"])
    weights = np.asarray(data["weights"], dtype=np.float64)
    bias = np.asarray(data["bias"], dtype=np.float64)
    vocabulary = tuple(str(w) for w in data.get("vocabulary", ()))
    if weights.ndim != 2 or weights.shape[0] != len(labels) or bias.shape != (len(labels),):
        raise ValueError(f"label head shapes: weights {weights.shape}, bias {bias.shape} for {len(labels)} labels")
    if vocabulary and weights.shape[1] <= len(vocabulary):
        raise ValueError(f"label head shapes: weights {weights.shape} for a vocabulary of {len(vocabulary)} words")
    known = {"format", "labels", "model", "text_threshold", "nsfw_threshold", "bias", "weights", "vocabulary",
             "word_scale"}
    return LabelHead(labels, weights, bias, float(data["text_threshold"]), float(data["nsfw_threshold"]),
                     str(data["model"]), vocabulary, float(data.get("word_scale", 0.0)),
                     {k: v for k, v in data.items() if k not in known})


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
