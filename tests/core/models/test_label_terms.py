"""Explicit terms (prx_core.models.label_terms): slang and act words force nsfw in the minilm labeller,
words with an innocent reading do not, and no visual or text caption of the labelled set, the
labeller's calibration sets or the demo matches; the switch and the list enter the version."""

from __future__ import annotations

import pytest
from test_labels import DEMO_PHOTOS, DEMO_TEXT, LONG_PHOTOS, LONG_TEXT, NSFW, VARIED_PHOTOS

from prx_core.models.label_base import LabelerConfig
from prx_core.models.label_head import labelled_rows
from prx_core.models.label_terms import EXPLICIT_TERMS, explicit_term, terms_digest
from prx_core.models.labels import MiniLMLabeler

EXPLICIT = [
    ("Blonde giving a hand-job by the pool", "hand-job"), ("BLOWJOB in a parked van", "BLOWJOB"),
    ("Amateur couple getting fucked on a sofa", "getting fucked"), ("His cock in her mouth", "His cock"),
    ("She is sucking dick behind a bar", "sucking dick"), ("Brunette with her pussy on show", "her pussy"),
    ("Cumshot compilation thumbnail", "Cumshot"), ("Girl creampied by two men", "creampied"),
    ("Doggy-style on a hotel bed", "Doggy-style"), ("Webcam model masturbating", "masturbating"),
    ("Three men in a gangbang", "gangbang"), ("Milf in a porn parody", "Milf"),
]
INNOCENT = [
    "Slice of banana cream pie on a diner counter", "A cock crowing on a farm fence at dawn",
    "Blue tits and great tits at a bird feeder", "Pussy willow branches in a glass vase",
    "Cyclist about to strap on her helmet", "Guitar fingering chart for beginners",
    "First edition of Moby Dick in a glass case", "Diploma awarded summa cum laude",
    "Portrait of a man sixty-nine years old", "Hardcore punk band on a small stage",
    "Leaflet for a sex education class", "Same-sex couple cutting their wedding cake",
    "The Glory Hole spillway of a dam after heavy rain", "Nude sculpture in a museum courtyard",
    "Labelled diagram of the penis and testes in a biology textbook", "Mother breastfeeding her baby",
    "Protest sign reading 'Fuck the system' held by a student", "Gymnast doing the splits on a beam",
    "Pegging out the washing on a sunny day", "A cat and her kittens, a real pussycat family",
]


@pytest.mark.parametrize("caption, term", EXPLICIT)
def test_explicit_terms_are_found_in_any_case_and_spelling(caption: str, term: str) -> None:
    assert explicit_term(caption) == term


@pytest.mark.parametrize("caption", INNOCENT)
def test_innocent_readings_and_anatomy_or_art_words_do_not_match(caption: str) -> None:
    assert explicit_term(caption) is None


def test_no_visual_or_text_caption_anywhere_matches() -> None:
    """Every visual and text caption of the labelled set (train and held out, all rounds) and of the
    labeller's calibration sets: a match would force a photo or a document to nsfw."""
    labelled = [r["caption"] for r in labelled_rows() if r["label"] != "nsfw"]
    assert len(labelled) > 600
    calibration = DEMO_TEXT + DEMO_PHOTOS + VARIED_PHOTOS + LONG_PHOTOS + LONG_TEXT
    hits = [(c[:60], explicit_term(c)) for c in labelled + calibration if explicit_term(c)]
    assert hits == []
    assert explicit_term(None) is None and explicit_term("") is None
    assert any(explicit_term(c) for c in NSFW)


def test_the_labeller_forces_nsfw_on_a_term_and_the_switch_enters_the_version() -> None:
    caption = "Woman giving a footjob on a sofa"
    on = MiniLMLabeler(LabelerConfig()).label_batch([caption, "A red bicycle against a wall"])
    assert on[0].label == "nsfw" and on[0].scores["nsfw"] == on[0].score == 1.0
    assert on[1].label == "visual" and on[1].scores["nsfw"] < 1.0
    off_config = LabelerConfig(explicit_terms=False)
    off = MiniLMLabeler(off_config).label_batch([caption])[0]
    assert off.scores["nsfw"] < 1.0 and off.scores["visual"] == pytest.approx(on[0].scores["visual"], abs=1e-5)  # only nsfw
    assert off_config.version() != LabelerConfig().version()
    similarity = LabelerConfig(method="similarity")
    assert similarity.explicit_terms is False  # its stored labels stay current
    assert LabelerConfig(method="similarity", explicit_terms=True).version() != similarity.version()
    with pytest.raises(ValueError, match="minilm option"):
        LabelerConfig(backend="llm", model="m", endpoint="http://127.0.0.1:1/v1", explicit_terms=True)
    assert len(terms_digest()) == 64 and len(EXPLICIT_TERMS) > 30
