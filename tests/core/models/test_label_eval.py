"""The evaluation maths of `prx-corpus eval-labels` (prx_core.models.label_eval) on a small hand-made
fixture: results are given, no model runs, so every count below is checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prx_core.models.label_base import LabelerConfig, LabelResult
from prx_core.models.label_eval import (
    FAILED,
    Labelled,
    LabelledFileError,
    evaluate,
    format_evaluation,
    read_labelled,
    results_from_rows,
)

CONFIG = LabelerConfig(method="similarity", text_threshold=0.4, nsfw_threshold=0.5)


def result(visual: float, text: float, nsfw: float) -> LabelResult:
    from prx_core.models.label_base import choose_label

    scores = {"visual": visual, "text": text, "nsfw": nsfw}
    label = choose_label(scores, CONFIG)
    return LabelResult(label, scores[label], scores)


FIXTURE = [  # (labelled, result): 10 captions, 7 right
    (Labelled("a beach", "visual", "plain"), result(0.6, 0.1, 0.2)),  # visual, right
    (Labelled("a shop sign", "visual", "incidental"), result(0.3, 0.45, 0.1)),  # text (0.45 >= 0.4, > 0.3): wrong
    (Labelled("a statue", "visual", "art"), result(0.5, 0.1, 0.52)),  # nsfw (0.52 >= 0.5): wrong
    (Labelled("a bar chart", "text", "chart"), result(0.2, 0.7, 0.0)),  # text, right
    (Labelled("a menu", "text", "menu"), result(0.45, 0.42, 0.0)),  # visual (0.42 < 0.45): wrong
    (Labelled("a slide", "text", "slide"), result(0.1, 0.39, 0.0)),  # visual (0.39 < 0.4): wrong
    (Labelled("porn", "nsfw", "photo"), result(0.4, 0.0, 0.9)),  # nsfw, right
    (Labelled("hentai", "nsfw", "drawing"), result(0.4, 0.0, 0.49)),  # visual: a missed explicit caption
    (Labelled("a document", "text", "doc"), LabelResult("", 0.0, {}, "http_503: down")),  # failed
    (Labelled("a cat", "visual", "plain"), result(0.7, 0.2, 0.1)),  # visual, right
]


def test_counts_precision_recall_and_failures() -> None:
    labelled, results = [a for a, _ in FIXTURE], [b for _, b in FIXTURE]
    ev = evaluate(labelled, results, CONFIG, nearest=2)
    # predicted: visual = beach, menu, slide, hentai, cat (5); text = sign, chart (2); nsfw = statue, porn (2); failed 1
    assert ev.captions == 10 and ev.accuracy == pytest.approx(4 / 10)  # beach, chart, porn, cat
    assert ev.confusion == {
        "visual": {"visual": 2, "text": 1, "nsfw": 1, FAILED: 0},
        "text": {"visual": 2, "text": 1, "nsfw": 0, FAILED: 1},
        "nsfw": {"visual": 1, "text": 0, "nsfw": 1, FAILED: 0},
    }
    assert ev.per_class["visual"] == {"precision": 2 / 5, "recall": 2 / 4, "labelled": 4, "predicted": 5}
    assert ev.per_class["text"] == {"precision": 1 / 2, "recall": 1 / 4, "labelled": 4, "predicted": 2}
    assert ev.per_class["nsfw"] == {"precision": 1 / 2, "recall": 1 / 2, "labelled": 2, "predicted": 2}
    assert ev.failures == {"http_503": 1}
    assert [m.caption for m in ev.mistakes] == ["a shop sign", "a statue", "a menu", "a slide", "hentai", "a document"]
    assert ev.by_kind["incidental"] == {"captions": 1, "wrong": 1, "predicted": {"text": 1}}
    assert "plain" not in ev.by_kind  # kinds without a mistake are not listed


def test_nearest_each_boundary_with_signed_margins() -> None:
    ev = evaluate([a for a, _ in FIXTURE], [b for _, b in FIXTURE], CONFIG, nearest=3)
    (nsfw_name, nsfw), (text_name, text) = ev.nearest.items()
    assert nsfw_name == "nsfw threshold 0.5" and text_name.startswith("text boundary (threshold 0.4")
    assert [(s.caption, s.margin) for s in nsfw] == [("hentai", -0.01), ("a statue", 0.02), ("a beach", -0.3)]
    # text margin = min(text - 0.4, text - visual), over captions below the nsfw threshold
    assert [(s.caption, round(s.margin, 6)) for s in text] == [("a slide", -0.01), ("a menu", -0.03), ("a shop sign", 0.05)]
    assert "a document" not in {s.caption for s in nsfw + text}  # no scores: on no boundary


def test_llm_has_no_thresholds_and_a_clean_run_no_failed_column() -> None:
    llm = LabelerConfig(backend="llm", model="m", endpoint="http://127.0.0.1:1/v1")
    labelled = [Labelled("a cat", "visual"), Labelled("a chart", "text")]
    results = [LabelResult("visual", 1.0, {"visual": 1.0, "text": 0.0, "nsfw": 0.0}),
               LabelResult("visual", 1.0, {"visual": 1.0, "text": 0.0, "nsfw": 0.0})]
    ev = evaluate(labelled, results, llm)
    assert ev.nearest == {} and ev.failures == {} and FAILED not in ev.confusion["visual"]
    assert ev.per_class["text"] == {"precision": None, "recall": 0.0, "labelled": 1, "predicted": 0}
    printed = format_evaluation(ev, "f.jsonl")
    assert "accuracy 0.500 (1 / 2)" in printed and "llm m over openai" in printed and "nearest" not in printed
    assert json.loads(json.dumps(ev.to_json()))["per_class"]["text"]["precision"] is None
    with pytest.raises(ValueError, match="1 results for 2"):
        evaluate(labelled, results[:1], llm)


def test_format_shows_the_table_matrix_mistakes_and_boundaries() -> None:
    ev = evaluate([a for a, _ in FIXTURE], [b for _, b in FIXTURE], CONFIG, nearest=2)
    printed = format_evaluation(ev)
    assert "accuracy 0.400 (4 / 10)" in printed
    assert "visual       0.400   0.500         4         5" in printed
    assert "text            2       1       0       1" in printed  # the confusion row, failed column last
    assert "no label: http_503 1" in printed and "mistakes: 6" in printed
    assert "nsfw -> visual drawing" in printed and "nearest the nsfw threshold 0.5" in printed


def test_read_labelled_takes_a_split_and_refuses_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"caption": "a cat", "label": "visual", "kind": "plain", "split": "train"}\n\n'
                    '{"caption": "a chart", "label": "text", "split": "heldout"}\n')
    assert read_labelled(good) == [Labelled("a cat", "visual", "plain"), Labelled("a chart", "text", "")]
    assert read_labelled(good, "heldout") == [Labelled("a chart", "text", "")]
    with pytest.raises(LabelledFileError, match="no labelled captions with split 'test'"):
        read_labelled(good, "test")
    for line, message in [('{"caption": "x", "label": "porn"}', r'bad.jsonl:2: "label" must be one of'),
                          ('{"caption": "  ", "label": "text"}', "bad.jsonl:2: needs a non-blank string"),
                          ('["x", "text"]', "bad.jsonl:2: needs a non-blank string"),
                          ("{caption: x}", "bad.jsonl:2: not JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"caption": "ok", "label": "visual"}\n' + line + "\n")
        with pytest.raises(LabelledFileError, match=message):
            read_labelled(bad)


def test_vllm_rows_come_back_in_caption_order() -> None:
    rows = [{"content_id": "2", "label": "nsfw", "score": 1.0, "error": ""},
            {"content_id": "0", "label": "", "score": 0.0, "error": "unparseable: 'maybe'"}]
    out = results_from_rows(rows, 3)
    assert [r.label for r in out] == ["", "", "nsfw"]
    assert [r.error for r in out] == ["unparseable: 'maybe'", "missing: no row came back", None]


def test_the_vllm_transport_labels_through_ray_data(ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """label_captions over `ray.data.llm`'s own Processor (prx_core.models.labels_vllm), generation a
    stand-in answering by caption (test_labels_vllm), results back in caption order."""
    import test_labels_vllm
    from test_labels_vllm import stand_in_processor

    from prx_core.models import labels_vllm
    from prx_core.models.label_eval import label_captions

    ray_cluster.cloudpickle.register_pickle_by_value(test_labels_vllm)
    answers = {"a beach": "visual", "an invoice": "text", "porn": "nsfw", "rambling": "visual or text", "boom": None}
    monkeypatch.setattr(labels_vllm, "build_vllm_processor", lambda cfg: stand_in_processor(cfg, answers))
    config = LabelerConfig(backend="llm", model="Qwen/Qwen3-8B", transport="vllm", max_tokens=4)
    captions = ["porn", "a beach", "boom", "an invoice", "rambling"] * 3
    results = label_captions(config, captions)
    assert [r.label for r in results] == ["nsfw", "visual", "", "text", ""] * 3
    assert [(r.error or "").split(":")[0] for r in results[:5]] == ["", "", "generation_error", "", "unparseable"]
    ev = evaluate([Labelled(c, {"porn": "nsfw", "a beach": "visual"}.get(c, "text")) for c in captions], results, config)
    assert ev.accuracy == pytest.approx(3 / 5) and ev.failures == {"generation_error": 3, "unparseable": 3}
