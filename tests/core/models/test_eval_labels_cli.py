"""`prx-corpus eval-labels` end to end on a small file: the default labeller (MiniLM with its head),
the similarity method and an llm behind a real OpenAI-compatible server on loopback, each resolved
from the settings as `build` resolves them; bad requests exit 2 naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_labels_llm import ScriptedServer

from prx_cli.main import main

CAPTIONS = [
    ("A photograph of a red bicycle leaning against a brick wall beside a blue front door in the sun", "visual"),
    ("Screenshot of a spreadsheet with a green header row and columns of numbers", "text"),
    ("Presentation slide with a blue title bar and a list of bullet points", "text"),
    ("explicit pornographic photo of a naked couple having sex", "nsfw"),
    ("A golden retriever running across a grassy park with a red ball in its mouth", "visual"),
    ("A bar chart of monthly rainfall in Paris with the values printed above each bar", "text"),
]


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    lines = [json.dumps({"caption": c, "label": label, "kind": "k", "split": "heldout" if i % 2 else "train",
                         "round": 1 + i // 3}) for i, (c, label) in enumerate(CAPTIONS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_default_labeller_on_a_small_file(labelled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("PRX_CONFIG", raising=False)
    out = tmp_path / "eval.json"
    assert main(["eval-labels", "--labelled", str(labelled), "--json", str(out), "--nearest", "2"]) == 0
    printed = capsys.readouterr().out
    assert "minilm head" in printed and "accuracy 1.000 (6 / 6)" in printed
    assert "nearest the nsfw threshold" in printed and "nearest the text boundary" in printed
    result = json.loads(out.read_text())
    assert result["captions"] == 6 and result["accuracy"] == 1.0 and result["labeler_id"].startswith("minilm:")
    assert result["confusion"]["text"] == {"visual": 0, "text": 3, "nsfw": 0}
    assert all(len(v) == 2 for v in result["nearest"].values())
    assert main(["eval-labels", "--labelled", str(labelled), "--split", "heldout"]) == 0
    assert "3 labelled captions" in capsys.readouterr().out
    assert main(["eval-labels", "--labelled", str(labelled), "--split", "heldout", "--round", "2"]) == 0
    printed = capsys.readouterr().out
    assert "2 labelled captions" in printed and "(split heldout, round 2)" in printed
    assert main(["eval-labels", "--labelled", str(labelled), "--round", "1, 2"]) == 0
    assert "6 labelled captions" in capsys.readouterr().out


def test_the_configured_method_is_the_one_measured(labelled: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "prx.yaml"
    config.write_text("labeler: {method: similarity, nsfw_threshold: 0.99}\n")  # nothing reaches 0.99: nsfw missed
    assert main(["eval-labels", "--labelled", str(labelled), "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "minilm similarity" in printed and "nsfw when score >= 0.99" in printed
    assert "nsfw -> visual" in printed
    assert "nsfw             -   0.000         1         0" in printed  # precision undefined: nothing predicted nsfw


def test_an_llm_behind_an_endpoint(labelled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = {CAPTIONS[0][0]: ["visual"], CAPTIONS[1][0]: ["text"], CAPTIONS[2][0]: ["I think it is a slide"],
               CAPTIONS[3][0]: ["nsfw"], CAPTIONS[4][0]: [("status", 503)], CAPTIONS[5][0]: ["visual"]}
    server = ScriptedServer(answers)
    try:
        config = tmp_path / "prx.yaml"
        config.write_text(f"labeler: {{backend: llm, model: qwen, endpoint: '{server.endpoint}', max_retries: 0}}\n")
        out = tmp_path / "eval.json"
        assert main(["eval-labels", "--labelled", str(labelled), "--config", str(config), "--json", str(out)]) == 0
    finally:
        server.close()
    printed = capsys.readouterr().out
    assert "llm qwen over openai" in printed and "accuracy 0.500 (3 / 6)" in printed
    result = json.loads(out.read_text())
    assert result["failures"] == {"unparseable": 1, "http_503": 1} and result["nearest"] == {}
    assert result["confusion"]["text"] == {"visual": 1, "text": 1, "nsfw": 0, "failed": 1}
    assert result["confusion"]["visual"]["failed"] == 1
    assert sorted(server.calls.values()) == [1] * 6  # every caption asked once


def test_bad_requests_exit_2(labelled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"caption": "a cat", "label": "cat"}\n')
    assert main(["eval-labels", "--labelled", str(bad)]) == 2
    assert 'bad.jsonl:1: "label" must be one of visual, text, nsfw' in capsys.readouterr().err
    assert main(["eval-labels", "--labelled", str(tmp_path / "missing.jsonl")]) == 2
    assert "--labelled:" in capsys.readouterr().err
    assert main(["eval-labels", "--labelled", str(labelled), "--round", "7"]) == 2
    assert "no labelled captions in round 7" in capsys.readouterr().err
    assert main(["eval-labels", "--labelled", str(labelled), "--round", ","]) == 2
    assert "names no round" in capsys.readouterr().err
    config = tmp_path / "prx.yaml"
    config.write_text("labeler: {method: knn}\n")
    assert main(["eval-labels", "--labelled", str(labelled), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "labeler settings:" in err and "known methods: head, similarity" in err
