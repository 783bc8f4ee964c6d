"""The labeller's head (prx_core.models.label_head): the shipped file matches the data and model it
claims, its decision rule is the labeller's, and the training maths is deterministic and learns
(on small fixtures; the shipped head's held-out numbers are tests/core/models/test_label_heldout.py)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from prx_core.models.embeddings import model_identity
from prx_core.models.label_base import LABELS, LabelerConfig, choose_label
from prx_core.models.label_head import (
    HEAD_PATH,
    LABELLED_PATH,
    PHOTO_WITH_TEXT,
    head_from_json,
    labelled_rows,
    load_head,
    rows_digest,
)
from prx_core.models.label_head_train import choose, class_weights, decide, fit_softmax, folds_of, softmax


def test_shipped_head_is_trained_on_the_current_train_split_of_this_model() -> None:
    head = load_head()
    assert head.labels == LABELS and head.weights.shape == (3, 384) and head.bias.shape == (3,)
    assert head.model == model_identity()
    trained = head.meta["trained_on"]
    assert trained["split"] == "train" and trained["rows"] == len(labelled_rows(split="train"))
    assert trained["sha256"] == rows_digest(labelled_rows(split="train"))  # retrain after editing the data
    assert 0.0 < head.text_threshold < 1.0 and 0.0 < head.nsfw_threshold < 1.0
    chosen = head.meta["cross_validation"]["chosen"]
    assert (chosen["l2"], chosen["text_threshold"], chosen["nsfw_threshold"]) == (
        head.meta["l2"], head.text_threshold, head.nsfw_threshold)
    config = LabelerConfig()
    assert (config.method, config.text_threshold, config.nsfw_threshold) == ("head", head.text_threshold, head.nsfw_threshold)
    assert HEAD_PATH.stat().st_size < 64_000  # a small file shipped with the package


def test_labelled_set_splits_by_caption_hash_and_covers_the_hard_cases() -> None:
    """Rounds 1-3 split by each caption's hash; round 4, written after rounds 1-3 were measured,
    is held out whole (a fresh measure of the method chosen on them)."""
    rows = labelled_rows()
    for row in rows:
        held = int(hashlib.sha256(row["caption"].encode()).hexdigest()[:8], 16) % 100 < 30
        expected = {4: "heldout"}.get(row["round"], "heldout" if held else "train")
        assert row["round"] in (1, 2, 3, 4) and row["split"] == expected, row["caption"][:60]
        assert row["label"] in LABELS and row["kind"]
    assert sum(r["split"] == "heldout" and r["round"] < 4 for r in rows) == 231  # round 4 moved none of these
    assert len({r["caption"] for r in rows}) == len(rows)  # no caption twice
    long = [r for r in rows if not r["kind"].startswith("short")]
    assert all(100 <= len(r["caption"].split()) <= 200 for r in long) and len(long) >= 300
    kinds = {r["kind"] for r in rows}
    assert {"incidental_text", "chart", "map", "menu", "infographic", "screenshot", "meme", "document", "slide",
            "art_nude", "swimwear", "explicit_photo", "explicit_illustration"} <= kinds
    assert set(PHOTO_WITH_TEXT) <= kinds
    assert LABELLED_PATH.name == "labelled_captions.jsonl"


def test_decide_is_choose_label() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet([1.0, 1.0, 1.0], size=400)
    config = LabelerConfig(text_threshold=0.4, nsfw_threshold=0.3)
    expected = [LABELS.index(choose_label(dict(zip(LABELS, row)), config)) for row in p]
    assert decide(p, LABELS, 0.4, 0.3).tolist() == expected


def test_json_round_trip_and_digest_follows_the_weights() -> None:
    head = load_head()
    again = head_from_json(head.to_json())
    assert again.digest() == head.digest() and again.meta == head.meta
    vectors = np.eye(3, 384)
    np.testing.assert_allclose(again.probabilities(vectors), head.probabilities(vectors))
    np.testing.assert_allclose(head.probabilities(vectors).sum(axis=1), 1.0)
    nudged = head.to_json()
    nudged["weights"][0][0] += 1e-9
    assert head_from_json(nudged).digest() != head.digest()
    with pytest.raises(ValueError, match="format"):
        head_from_json({**head.to_json(), "format": 99})
    with pytest.raises(ValueError, match="shapes"):
        head_from_json({**head.to_json(), "bias": [0.0, 0.0]})


def clusters(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian clusters on the unit sphere of R^8, imbalanced like real labels."""
    rng = np.random.default_rng(seed)
    centres = np.eye(8)[:3] * 3.0
    y = np.repeat([0, 1, 2], [n, n // 2, n // 4])
    x = centres[y] + rng.normal(size=(len(y), 8))
    return x / np.linalg.norm(x, axis=1, keepdims=True), y


def test_fit_is_deterministic_balanced_and_learns() -> None:
    x, y = clusters(80, seed=1)
    w1, b1 = fit_softmax(x, y, 1e-3, 3)
    w2, b2 = fit_softmax(x, y, 1e-3, 3)
    assert np.array_equal(w1, w2) and np.array_equal(b1, b2)
    test_x, test_y = clusters(80, seed=2)
    assert (softmax(test_x, w1, b1).argmax(axis=1) == test_y).mean() > 0.9
    assert class_weights(y, 3).tolist() == pytest.approx([140 / 240, 140 / 120, 140 / 60])
    strong, _ = fit_softmax(x, y, 1.0, 3)
    assert np.abs(strong).sum() < np.abs(w1).sum()  # the penalty shrinks the weights
    with pytest.raises(ValueError, match="every label"):
        class_weights(np.array([0, 0, 1]), 3)


def test_choose_prefers_recall_and_spares_photos_with_text() -> None:
    x, y = clusters(60, seed=3)
    captions = [f"caption {i}" for i in range(len(y))]
    assert folds_of(captions, 0).tolist() == folds_of(captions, 0).tolist() != folds_of(captions, 1).tolist()
    kinds = ["incidental_text" if label == 0 and i % 3 == 0 else "x" for i, label in enumerate(y)]
    best, per_l2 = choose(x, y, captions, kinds, LABELS, l2_grid=(1e-3, 1e-1), repeats=1)
    assert [c.l2 for c in per_l2] == [1e-3, 1e-1] and best in per_l2
    assert best.cost == min(c.cost for c in per_l2) and best.missed_nsfw == 0 and best.photo_to_text == 0
    assert best.accuracy > 0.9
