"""The `openai` captioner and the `llm` labeller's openai transport against a real `vllm serve`
on 127.0.0.1: the server is vLLM's CPU build from the vLLM test environment (one per module,
~1 min to start), serving the tiny random Qwen2-VL; the clients are the pipeline's own."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from vllm_engine import SERVED_NAME, VLLMServer, engine_python

from prx_core.demo.photos import load_skimage_photos
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.captioning import build_captioner
from prx_core.models.label_base import LABELS, LabelerConfig
from prx_core.models.labels import build_labeler
from prx_core.models.tiny_vlm import TINY_MAX_PIXELS, build_tiny_qwen2_vl

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    work = tmp_path_factory.mktemp("vllm-serve")
    checkpoint = build_tiny_qwen2_vl(work / SERVED_NAME)
    served = VLLMServer(engine_python(), checkpoint, work / "vllm-serve.log")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    out = []
    for photo in [p for p in load_skimage_photos() if p.image.mode == "RGB"][:4]:
        buffer = io.BytesIO()
        photo.image.resize((320, 240)).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def test_the_openai_captioner_records_finish_reason_tokens_and_time(server: VLLMServer, photos: list[bytes]) -> None:
    config = CaptionerConfig("openai", model=SERVED_NAME, endpoint=server.url, max_new_tokens=MAX_NEW_TOKENS,
                             max_pixels=TINY_MAX_PIXELS, batch_size=4, concurrency=4, timeout_s=120)
    captioner = build_captioner(config)
    results = captioner.caption_batch([*photos, b"not an image"], [None] * (len(photos) + 1))
    *captioned, junk = results
    assert junk.error is not None and junk.error.startswith("decode_error"), junk
    for result, usage in zip(captioned, captioner.last_usage):
        assert result.error is None and result.caption, (result, server.tail())
        # gibberish never reaches an end token: the cap stops every caption, and the server says so
        assert result.finish_reason == "length" and result.tokens == MAX_NEW_TOKENS, result
        assert usage["completion_tokens"] == MAX_NEW_TOKENS and usage["prompt_tokens"] > 100, usage
    assert captioner.usage["completion_tokens"] == MAX_NEW_TOKENS * len(photos)


def test_the_llm_labeller_gets_one_of_the_labels(server: VLLMServer) -> None:
    config = LabelerConfig(backend="llm", model=SERVED_NAME, endpoint=server.url, max_tokens=4,
                           constrained="structured_outputs", timeout_s=120, concurrency=4)
    results = build_labeler(config).label_batch(
        ["A red brick wall in sunlight.", "A scanned invoice with a table of prices.", ""])
    assert len(results) == 3
    for result in results[:2]:
        assert result.error is None and result.label in LABELS, (result, server.tail())
    assert results[2].label == "visual" and results[2].score == 0.0  # a blank caption is never sent
