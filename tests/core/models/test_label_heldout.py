"""The default labeller on the held-out captions it was not trained on (prx_core/models/data/
labelled_captions.jsonl, split heldout): what `prx-corpus eval-labels --split heldout --round ...`
reports, held to the targets of docs/benchmarks.md ("Caption labels"): no explicit caption missed,
no photo with incidental text sent to `text`, accuracy >= 0.95.

Two measures: rounds 1-3 (231 captions split off by hash, the set the method was first chosen on)
and round 8 (120 captions written on 2026-12-06 before this head was trained, held out whole; the
earlier fresh rounds 4, 6 and 7 had been spent on choosing the word head and are trained on since).
Round 8 meets every target. Rounds 1-3 meet accuracy and explicit recall, but one photo with an
overlaid title ("as on a food blog's cover") goes to `text` (p 0.77 against 0.70): the rate of
that error out of fold on the training split is 2.33 of 199 such photos (1.2%), so among 50 one
miss or more has a ~45% chance.
One embedding pass (~350 captions)."""

from __future__ import annotations

import pytest

from prx_core.models.label_base import LabelerConfig
from prx_core.models.label_eval import Evaluation, Scored, evaluate, label_captions, read_labelled
from prx_core.models.label_head import LABELLED_PATH, PHOTO_WITH_TEXT

OLD, FRESH = "1,2,3", "8"


def measure(rounds: str) -> Evaluation:
    labelled = read_labelled(LABELLED_PATH, split="heldout", rounds=rounds)
    config = LabelerConfig()
    assert config.method == "head" and config.explicit_terms
    return evaluate(labelled, label_captions(config, [item.caption for item in labelled]), config)


@pytest.fixture(scope="module")
def old() -> Evaluation:
    return measure(OLD)


@pytest.fixture(scope="module")
def fresh() -> Evaluation:
    return measure(FRESH)


def is_long(s: Scored) -> bool:
    return not s.kind.startswith("short")


def costly_errors(ev: Evaluation) -> tuple[list[str], list[str]]:
    """(explicit captions not labelled nsfw, photos with incidental text labelled text), any length."""
    missed = [m.caption[:80] for m in ev.mistakes if m.expected == "nsfw"]
    to_text = [m.caption[:80] for m in ev.mistakes if m.kind in PHOTO_WITH_TEXT and m.predicted == "text"]
    return missed, to_text


def test_rounds_1_to_3_meet_accuracy_and_explicit_recall(old: Evaluation) -> None:
    assert old.captions == 231 and old.accuracy >= 0.95, [(m.expected, m.predicted, m.caption[:60]) for m in old.mistakes]
    missed, to_text = costly_errors(old)
    assert missed == [] and old.per_class["nsfw"]["recall"] == 1.0  # short slang included ("handjob": an explicit term)
    assert len(to_text) <= 1, to_text  # the overlaid food-blog title (module doc): the target is none


def test_round_8_meets_every_target(fresh: Evaluation) -> None:
    assert fresh.captions == 120
    assert fresh.accuracy >= 0.95, [(m.expected, m.predicted, m.caption[:60]) for m in fresh.mistakes]
    assert costly_errors(fresh) == ([], [])
    assert fresh.per_class["nsfw"]["recall"] == 1.0
    long = [m for m in fresh.mistakes if is_long(m)]
    assert all(m.predicted == "nsfw" for m in long)  # long paragraphs: only the cheap direction, if any


def test_long_captions_are_most_of_the_measure(old: Evaluation) -> None:
    """The targets above are about enough long captions of each kind to mean something."""
    labelled = read_labelled(LABELLED_PATH, split="heldout", rounds=OLD)
    long = [item for item in labelled if not item.kind.startswith("short")]
    assert len(long) >= 90
    assert sum(item.label == "nsfw" for item in long) >= 25
    assert sum(item.kind in PHOTO_WITH_TEXT for item in long) >= 15
    wrong_long = [m for m in old.mistakes if is_long(m)]
    assert 1 - len(wrong_long) / len(long) >= 0.97
