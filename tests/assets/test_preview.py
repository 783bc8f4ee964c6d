"""`prx-corpus preview` (issue 43): the configured captioner and labeller on a few sampled images
of a source, printed with tokens, time, the caption checks' verdicts and the label, projected to
the whole source, and saved for the explorer's Previews page. On a small parquet source of real
photos with captions; the VLM is the tiny random Qwen2-VL (its captions run to the token cap, so
the checks refuse them twice: what a looping VLM would show before anyone paid for it)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from materializing import transformers_config
from PIL import Image

from prx_cli.main import main
from prx_core.demo.photos import load_skimage_photos
from prx_core.stages.preview import TABLE

ROWS = 10


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("preview")
    photos = [p.image.convert("RGB") for p in load_skimage_photos()][:ROWS]
    images, captions = [], []
    for i, photo in enumerate(photos):
        buffer = io.BytesIO()
        photo.resize((640, 480)).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
        captions.append(f"a photograph of a scene, number {i}, taken outdoors in daylight")
    (base / "photos").mkdir()
    pq.write_table(pa.table({"key": [f"p{i}" for i in range(ROWS)], "image": images, "caption": captions}),
                   base / "photos" / "part-0.parquet")
    (base / "sources.yaml").write_text(yaml.safe_dump({"sources": [
        {"name": "photos", "format": "parquet", "uri": "photos", "image_column": "image", "caption_column": "caption",
         "key_column": "key"}]}))
    return base / "sources.yaml"


def test_the_source_captioner_costs_nothing_and_is_saved_for_the_explorer(catalog: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    root, out = tmp_path / "corpus", tmp_path / "preview.json"
    assert main(["preview", "--sources", str(catalog), "--source", "photos", "--sample", "4", "--root", str(root),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert [x for x in printed.splitlines() if x.startswith("[")][0].startswith("[1] p0 640x480: ok, 0 tokens, label ")
    assert "a photograph of a scene, number 0" in printed
    assert "~0 GPU-hours" in printed and "no model runs, nothing to pay" in printed
    assert f"saved to {root}/lance/{TABLE}.lance" in printed
    rows = lance.dataset(str(root / "lance" / f"{TABLE}.lance")).to_table().to_pylist()
    assert [r["source_key"] for r in rows] == ["p0", "p1", "p2", "p3"]  # one file: its first images
    assert all(Image.open(io.BytesIO(r["thumbnail"])).size[0] == 256 for r in rows)
    assert {r["verdict"] for r in rows} == {"ok"} and all(r["label"] for r in rows)
    summary = json.loads(out.read_text())["summary"]
    assert summary["contents"] == ROWS and summary["projected_gpu_hours"] == 0


def test_a_vlm_is_previewed_with_its_tokens_verdicts_and_gpu_hours(catalog: Path, tiny_vlm: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "prx.yaml"
    config.write_text(yaml.safe_dump({"captioner": transformers_config(tiny_vlm)}))
    out = tmp_path / "preview.json"
    assert main(["preview", "--sources", str(catalog), "--source", "photos", "--sample", "2", "--config", str(config),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = [x for x in printed.splitlines() if x.startswith("[")]
    assert len(lines) == 2 and all(": rejected (token_cap), 16 tokens, 2 generations" in x for x in lines), lines
    assert ", label" not in lines[0]  # a refused caption is not labelled
    preview = json.loads(out.read_text())
    summary = preview["summary"]
    assert summary["verdicts"] == {"rejected": 2} and summary["tokens_per_image"] == 16
    assert summary["seconds_per_image"] > 0 and summary["load_s"] > 0
    assert summary["projected_gpu_hours"] == pytest.approx(ROWS / 20 / 3600 * 1.05)  # the plan's rate, 5% retried
    assert summary["projected_hours_here"] == pytest.approx(ROWS * summary["seconds_per_image"] / 3600, rel=1e-2)
    assert f"~{summary['projected_gpu_hours']:.3g} GPU-hours at 20 captions/s per GPU" in printed

    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(yaml.safe_dump({"captioner": {"backend": "vllm", "model": str(tiny_vlm)}}))
    assert main(["preview", "--sources", str(catalog), "--source", "photos", "--config", str(vllm)]) == 2
    assert "preview the same model and engine through vLLM's OpenAI server" in capsys.readouterr().err
