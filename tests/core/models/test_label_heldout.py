"""The default labeller on the held-out captions it was not trained on (prx_core/models/data/
labelled_captions.jsonl, split heldout): what `prx-corpus eval-labels --split heldout` reports,
held to the targets of docs/benchmarks.md ("Caption labels"). Long VLM-style paragraphs (what PRX's
captioner writes): no explicit caption missed, no photo with incidental text sent to `text`. All
of them, short source captions included: accuracy >= 0.95. One embedding pass (~225 captions)."""

from __future__ import annotations

import pytest

from prx_core.models.label_base import LabelerConfig
from prx_core.models.label_eval import Evaluation, Scored, evaluate, label_captions, read_labelled
from prx_core.models.label_head import LABELLED_PATH, PHOTO_WITH_TEXT


@pytest.fixture(scope="module")
def heldout() -> Evaluation:
    labelled = read_labelled(LABELLED_PATH, split="heldout", rounds="1,2,3")
    config = LabelerConfig()
    assert config.method == "head"
    return evaluate(labelled, label_captions(config, [item.caption for item in labelled]), config)


def is_long(s: Scored) -> bool:
    return not s.kind.startswith("short")


def test_accuracy_on_every_heldout_caption(heldout: Evaluation) -> None:
    assert heldout.captions >= 200 and heldout.accuracy >= 0.95, [(m.expected, m.predicted, m.caption[:60])
                                                                  for m in heldout.mistakes]
    assert heldout.per_class["nsfw"]["recall"] >= 0.95  # short slang included


def test_long_captions_miss_no_explicit_caption_and_keep_photos_with_text_visual(heldout: Evaluation) -> None:
    missed = [m.caption[:80] for m in heldout.mistakes if is_long(m) and m.expected == "nsfw"]
    to_text = [m.caption[:80] for m in heldout.mistakes
               if is_long(m) and m.kind in PHOTO_WITH_TEXT and m.predicted == "text"]
    assert missed == [] and to_text == []


def test_long_captions_are_most_of_the_measure(heldout: Evaluation) -> None:
    """The targets above are about enough long captions of each kind to mean something."""
    labelled = read_labelled(LABELLED_PATH, split="heldout", rounds="1,2,3")
    long = [item for item in labelled if not item.kind.startswith("short")]
    assert len(long) >= 90
    assert sum(item.label == "nsfw" for item in long) >= 25
    assert sum(item.kind in PHOTO_WITH_TEXT for item in long) >= 15
    wrong_long = [m for m in heldout.mistakes if is_long(m)]
    assert 1 - len(wrong_long) / len(long) >= 0.97
