"""Captioner layer: the source and transformers backends, their id/version, and the Ray Data
callable, on a tiny randomly initialised Qwen2-VL checkpoint built locally (no downloads)."""

from __future__ import annotations

import io
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image

from prx_core.models.caption_base import CaptionerConfig, CaptionResult, prepare_image, word_count
from prx_core.models.captioning import CaptionBatch, SourceCaptioner, build_captioner, checked_captions
from prx_core.models.captioning_transformers import TransformersCaptioner
from prx_core.models.prompts import CAPTION_PROMPT, PROMPT_VERSION
from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

TINY_PIXELS = 112 * 112
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/core/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", seed=0)


@pytest.fixture(scope="module")
def config(checkpoint: Path) -> CaptionerConfig:
    return CaptionerConfig(
        "transformers", model=str(checkpoint), max_new_tokens=12, max_pixels=TINY_PIXELS, batch_size=4
    )


@pytest.fixture(scope="module")
def captioner(config: CaptionerConfig) -> TransformersCaptioner:
    return TransformersCaptioner(config)


def test_prompt_is_one_paragraph_of_rules() -> None:
    assert "\n" not in CAPTION_PROMPT and 80 <= word_count(CAPTION_PROMPT) <= 200
    assert re.fullmatch(r"caption-v\d+", PROMPT_VERSION)
    for rule in ("literal", "verbatim", "overlay", "colours", "materials", "metaphor"):
        assert rule in CAPTION_PROMPT


def test_source_copies_stripped_caption_and_records_missing() -> None:
    captioner = build_captioner(CaptionerConfig("source"))
    assert isinstance(captioner, SourceCaptioner)
    results = captioner.caption_batch([b"", b"x", b"y", b"z"], ["  A red door.\n", None, "", " \t "])
    assert results[0] == CaptionResult("A red door.")
    assert [r.reason for r in results] == [None, "no_source_caption", "no_source_caption", "no_source_caption"]
    assert all(r.caption is None for r in results[1:])
    with pytest.raises(ValueError, match="2 images but 1"):
        captioner.caption_batch([b"", b""], ["a"])


def test_config_validation_names_known_backends() -> None:
    with pytest.raises(ValueError, match="known backends: source, transformers"):
        CaptionerConfig("vlm")
    with pytest.raises(ValueError, match="model"):
        CaptionerConfig("transformers")
    with pytest.raises(ValueError):
        CaptionerConfig("source", top_p=0.0)


def test_source_version_ignores_sampling_prompt_and_pixels() -> None:
    base = CaptionerConfig("source")
    assert base.captioner_id() == "source"
    for other in (
        CaptionerConfig("source", temperature=0.8, top_p=0.5, max_new_tokens=10),
        CaptionerConfig("source", prompt_version="caption-v9", max_pixels=64 * 64),
    ):
        assert other.version() == base.version() and other.captioner_id() == "source"
    assert base.recorded_prompt_version() == ""


def test_transformers_id_and_version_stable_and_sensitive(
    checkpoint: Path, config: CaptionerConfig, tmp_path: Path
) -> None:
    same = CaptionerConfig("transformers", model=str(checkpoint), max_new_tokens=12, max_pixels=TINY_PIXELS)
    assert same.version() == config.version() and same.captioner_id() == config.captioner_id()
    assert replace(config, batch_size=1).version() == config.version()  # same output per image
    assert re.fullmatch(r"transformers:tiny-qwen2-vl:[0-9a-f]{12}", config.captioner_id())
    assert config.captioner_id().endswith(config.version()[:12])
    moved = shutil.copytree(checkpoint, tmp_path / "elsewhere" / checkpoint.name)
    assert replace(config, model=str(moved)).captioner_id() == config.captioner_id()  # content, not path

    reseeded = build_tiny_qwen2_vl(tmp_path / "seed1" / checkpoint.name, seed=1)  # same files, same sizes
    changed = {
        "prompt": replace(config, prompt_version="caption-v2"),
        "weights": replace(config, model=str(reseeded)),
        "temperature": replace(config, temperature=0.7),
        "tokens": replace(config, max_new_tokens=13),
        "pixels": replace(config, max_pixels=TINY_PIXELS * 4),
    }
    versions = {name: c.version() for name, c in changed.items()}
    assert config.version() not in versions.values() and len(set(versions.values())) == len(versions)
    hot = changed["temperature"]
    assert replace(hot, top_p=0.9).version() != hot.version()
    assert replace(config, top_p=0.9).version() == config.version()  # greedy ignores top_p
    with pytest.raises(FileNotFoundError):
        CaptionerConfig("transformers", model=str(tmp_path / "missing")).version()


def test_tiny_checkpoint_is_deterministic_and_reused(checkpoint: Path, tmp_path: Path) -> None:
    again = build_tiny_qwen2_vl(tmp_path / checkpoint.name, seed=0)
    for file in checkpoint.iterdir():
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen2_vl(again, seed=0) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(FileExistsError):
        build_tiny_qwen2_vl(again, seed=1)


def test_generates_text_for_real_photos_in_order(captioner: TransformersCaptioner, photos: list[bytes]) -> None:
    batch = captioner.caption_batch(photos, [None] * len(photos))
    assert len(batch) == len(photos)
    assert all(r.error is None and r.caption and word_count(r.caption) > 0 for r in batch)
    # One at a time gives the same text: results are in input order and left padding is right.
    singles = [captioner.caption_batch([p], [None])[0] for p in photos]
    assert singles == batch
    assert len({r.caption for r in batch}) > 1  # the image reaches the model


def test_greedy_generation_is_deterministic(
    config: CaptionerConfig, captioner: TransformersCaptioner, photos: list[bytes]
) -> None:
    first = captioner.caption_batch(photos[:2], [None, None])
    assert captioner.caption_batch(photos[:2], [None, None]) == first
    assert TransformersCaptioner(config).caption_batch(photos[:2], [None, None]) == first


def test_bad_images_fail_alone(captioner: TransformersCaptioner, photos: list[bytes]) -> None:
    strip = io.BytesIO()
    Image.new("RGB", (1000, 4), "red").save(strip, format="PNG")  # aspect 250: the processor refuses
    inputs = [photos[0], photos[1][: len(photos[1]) // 2], b"not an image", strip.getvalue(), photos[2], b""]
    results = captioner.caption_batch(inputs, [None] * len(inputs))
    good = captioner.caption_batch([photos[0], photos[2]], [None, None])
    assert [r.reason for r in results] == [
        None, "decode_error:truncated", "decode_error:not_an_image", "generation_error", None, "decode_error:empty",
    ]
    assert [results[0], results[4]] == good
    assert "aspect ratio" in results[3].error


def test_images_are_capped_before_the_model(captioner: TransformersCaptioner) -> None:
    from transformers import Qwen2VLImageProcessorFast

    buffer = io.BytesIO()
    Image.fromarray(np.tile(skimage.data.coffee(), (4, 4, 1))).save(buffer, format="JPEG", quality=90)  # 2400 x 1600
    big = buffer.getvalue()
    image = prepare_image(big, TINY_PIXELS)
    assert isinstance(image, Image.Image) and image.width * image.height <= TINY_PIXELS
    assert image.width / image.height == pytest.approx(1.5, rel=0.02)
    inputs = captioner.processor(images=[image], text=[captioner.prompt], return_tensors="pt")
    patches = int(inputs["image_grid_thw"].prod())
    assert patches * 14 * 14 <= TINY_PIXELS
    assert Qwen2VLImageProcessorFast.size["longest_edge"] == 28 * 28 * 1280  # class default untouched


def test_caption_batch_on_numpy_object_arrays(config: CaptionerConfig, photos: list[bytes]) -> None:
    batch = {
        "content_id": np.array(["c0", "c1", "c2"], dtype=object),
        "image": np.array([photos[0], b"\x00" * 10, np.frombuffer(photos[1], dtype=np.uint8)], dtype=object),
        "original_caption": np.array([" a cat ", None, float("nan")], dtype=object),
    }
    source = CaptionBatch(CaptionerConfig("source"))(batch)
    assert list(source["caption"]) == ["a cat", "", ""]
    assert list(source["word_count"]) == [2, 0, 0] and source["word_count"].dtype == np.int64
    assert list(source["error"])[0] == "" and all(e.startswith("no_source_caption") for e in source["error"][1:])
    assert set(source["captioner_id"]) == {"source"} and set(source["prompt_version"]) == {""}

    out = CaptionBatch(config)({k: v for k, v in batch.items() if k != "original_caption"})
    assert set(out) == {
        "content_id", "caption", "captioner_id", "captioner_version", "prompt_version", "word_count", "error",
        "num_generated_tokens", "finish_reason", "verdict", "problem", "attempts",
    }
    assert list(out["content_id"]) == ["c0", "c1", "c2"] and all(len(col) == 3 for col in out.values())
    assert out["caption"][0] and out["caption"][2] and out["caption"][1] == ""
    assert out["error"][1].startswith("decode_error:") and out["error"][0] == out["error"][2] == ""
    assert set(out["captioner_version"]) == {config.version()} and set(out["prompt_version"]) == {PROMPT_VERSION}
    assert list(out["word_count"]) == [word_count(c) for c in out["caption"]]
    tokens = list(out["num_generated_tokens"])  # both attempts: the tiny model's gibberish fails the checks twice
    assert tokens[1] == 0 and all(config.max_new_tokens < t <= 2 * config.max_new_tokens for t in (tokens[0], tokens[2]))
    assert list(out["verdict"]) == ["rejected", "", "rejected"] and list(out["attempts"]) == [2, 1, 2]
    assert out["finish_reason"][0] == "length" and out["problem"][0] == "token_cap"


def test_caption_batch_in_a_ray_data_pipeline(
    config: CaptionerConfig, captioner: TransformersCaptioner, photos: list[bytes], ray_cluster
) -> None:
    ray = ray_cluster
    images = photos + [b"junk"] + photos[:2]
    items = [{"content_id": f"c{i}", "image": data, "original_caption": None} for i, data in enumerate(images)]
    expected = [c.result for c in checked_captions(captioner, [item["image"] for item in items], [None] * len(items))]
    dataset = ray.data.from_items(items).map_batches(
        CaptionBatch, fn_constructor_kwargs={"config": config}, concurrency=1, batch_size=4
    )
    rows = {row["content_id"]: row for row in dataset.take_all()}
    assert sorted(rows) == [item["content_id"] for item in items]
    for item, want in zip(items, expected):
        row = rows[item["content_id"]]
        assert row["caption"] == (want.caption or "") and row["error"] == (want.error or "")
        assert row["captioner_id"] == config.captioner_id() and row["word_count"] == word_count(row["caption"])
