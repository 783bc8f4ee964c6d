"""The default labeller on the held-out captions it was not trained on (prx_core/models/data/
labelled_captions.jsonl, split heldout): what `prx-corpus eval-labels --split heldout --round ...`
reports, held to the targets of docs/benchmarks.md ("Caption labels"): no explicit caption missed,
no photo with incidental text sent to `text`, accuracy >= 0.95.

Two measures: rounds 1-3 (231 captions split off by hash, the set the method was first chosen on)
and the fresh rounds 4, 6 and 7 (246 captions written later and held out whole). On the fresh
rounds the two costly errors are at zero, but accuracy is 0.931, not 0.95: short captions of a
document or chart photographed in a scene (a parking ticket, a setlist, a cinema ticket) go to
`visual` (the cost of keeping photos with text visual); the floor below pins today's figure.
One embedding pass (~480 captions)."""

from __future__ import annotations

import pytest

from prx_core.models.label_base import LabelerConfig
from prx_core.models.label_eval import Evaluation, Scored, evaluate, label_captions, read_labelled
from prx_core.models.label_head import LABELLED_PATH, PHOTO_WITH_TEXT

OLD, FRESH = "1,2,3", "4,6,7"


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


def test_rounds_1_to_3_meet_every_target(old: Evaluation) -> None:
    assert old.captions == 231 and old.accuracy >= 0.95, [(m.expected, m.predicted, m.caption[:60]) for m in old.mistakes]
    assert costly_errors(old) == ([], [])  # short slang included ("handjob": an explicit term)
    assert old.per_class["nsfw"]["recall"] == 1.0


def test_fresh_rounds_miss_no_explicit_caption_and_keep_photos_with_text_visual(fresh: Evaluation) -> None:
    assert fresh.captions == 246
    assert costly_errors(fresh) == ([], [])
    assert fresh.per_class["nsfw"]["recall"] == 1.0


def test_fresh_rounds_accuracy_floor(fresh: Evaluation) -> None:
    """0.931 today, below the 0.95 target (module doc): most mistakes are short text sent to visual."""
    assert fresh.accuracy >= 0.92, [(m.expected, m.predicted, m.caption[:60]) for m in fresh.mistakes]
    short_text_missed = [m for m in fresh.mistakes if m.expected == "text" and not is_long(m)]
    assert len(short_text_missed) >= len(fresh.mistakes) / 2  # the known weakness, not a new one
    long = [m for m in fresh.mistakes if is_long(m)]
    assert all(m.predicted == "nsfw" for m in long)  # long paragraphs: only the cheap direction


def test_long_captions_are_most_of_the_measure(old: Evaluation) -> None:
    """The targets above are about enough long captions of each kind to mean something."""
    labelled = read_labelled(LABELLED_PATH, split="heldout", rounds=OLD)
    long = [item for item in labelled if not item.kind.startswith("short")]
    assert len(long) >= 90
    assert sum(item.label == "nsfw" for item in long) >= 25
    assert sum(item.kind in PHOTO_WITH_TEXT for item in long) >= 15
    wrong_long = [m for m in old.mistakes if is_long(m)]
    assert 1 - len(wrong_long) / len(long) >= 0.97
