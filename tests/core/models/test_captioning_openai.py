"""The `openai` captioner backend against a real OpenAI-compatible server on loopback
(prx_core.models.serving) answering with the tiny local Qwen2-VL: real HTTP, real generation,
injected 429s, 500s and timeouts."""

from __future__ import annotations

import base64
import io
import re
import socket
from dataclasses import replace

import numpy as np
import pytest
from corpora import write_contents
from PIL import Image

from prx_core.models.caption_base import CaptionerConfig, CaptionResult
from prx_core.models.captioning import CaptionBatch, build_captioner
from prx_core.models.captioning_openai import OpenAICaptioner, encode_for_request, parse_response
from prx_core.models.captioning_transformers import TransformersCaptioner
from prx_core.compute.retries import retry_after_seconds
from prx_core.models.prompts import CAPTION_PROMPT, PROMPT_VERSION
from prx_core.models.serving import CaptionServer, Faults
from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

TINY_PIXELS = 112 * 112
SERVED = "tiny-qwen2-vl-served"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/core/conftest.py


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> TransformersCaptioner:
    checkpoint = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", seed=0)
    return TransformersCaptioner(CaptionerConfig(
        "transformers", model=str(checkpoint), max_new_tokens=12, max_pixels=TINY_PIXELS, batch_size=4,
    ))


@pytest.fixture(scope="module")
def server(local: TransformersCaptioner):
    with CaptionServer(local, SERVED, max_batch=4, record_bodies=True) as running:
        yield running


@pytest.fixture
def fresh(server: CaptionServer) -> CaptionServer:
    """The shared server with no faults and zeroed counters."""
    server.faults = Faults()
    server.stats = type(server.stats)()
    return server


@pytest.fixture
def config(server: CaptionServer) -> CaptionerConfig:
    return CaptionerConfig(
        "openai", model=SERVED, endpoint=server.url, max_new_tokens=12, temperature=0.0,
        max_pixels=TINY_PIXELS, concurrency=4, timeout_s=20.0, max_retries=3, backoff_s=0.01,
        check_captions=False,  # the transport's requests are counted here; the checks' retries: test_caption_quality
    )


def expected(local: TransformersCaptioner, images: list[bytes]) -> list[CaptionResult]:
    """What the same model says about exactly the JPEGs the client sends."""
    sent = [encode_for_request(data, TINY_PIXELS) for data in images]
    return local.caption_batch(sent, [None] * len(sent))


def test_config_version_ignores_transport_and_validates() -> None:
    base = CaptionerConfig("openai", model="Qwen/Qwen3-VL-8B-Instruct", endpoint="http://a:8000/v1")
    assert re.fullmatch(r"openai:Qwen3-VL-8B-Instruct:[0-9a-f]{12}", base.captioner_id())
    transport = replace(base, endpoint="https://b/v1", api_key_env="KEY", concurrency=64, timeout_s=5,
                        max_retries=0, backoff_s=2, batch_size=1)
    assert transport.version() == base.version()
    changed = [replace(base, model="other"), replace(base, prompt_version="caption-v9"), replace(base, temperature=0.7),
               replace(base, max_new_tokens=300), replace(base, max_pixels=1024 * 1024)]
    assert len({c.version() for c in changed} | {base.version()}) == len(changed) + 1
    assert base.recorded_prompt_version() == PROMPT_VERSION
    for bad in ({"model": ""}, {"endpoint": ""}, {"concurrency": 0}, {"timeout_s": 0}, {"max_retries": -1}):
        with pytest.raises(ValueError):
            replace(base, **bad)
    with pytest.raises(ValueError, match="openai"):
        CaptionerConfig("vlm")

    from prx_resources.models import CaptionerResource

    resource = CaptionerResource(backend="openai", model="m", endpoint="http://v:8000/v1", api_key_env="K",
                                 concurrency=3, timeout_s=7.5, max_retries=1, allow_insecure_http=True,
                                 max_response_bytes=4096, max_caption_chars=500)
    assert resource.config() == CaptionerConfig("openai", model="m", endpoint="http://v:8000/v1", api_key_env="K",
                                                concurrency=3, timeout_s=7.5, max_retries=1, allow_insecure_http=True,
                                                max_response_bytes=4096, max_caption_chars=500)


def test_api_key_comes_from_the_named_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    config = CaptionerConfig("openai", model="m", endpoint="http://127.0.0.1:9/v1", api_key_env="PRX_TEST_KEY")
    monkeypatch.delenv("PRX_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="PRX_TEST_KEY"):
        build_captioner(config)
    monkeypatch.setenv("PRX_TEST_KEY", "sk-test")
    captioner = build_captioner(config)
    assert isinstance(captioner, OpenAICaptioner) and captioner.client.headers["Authorization"] == "Bearer sk-test"
    assert captioner.client.url == "http://127.0.0.1:9/v1/chat/completions"


def test_response_parsing() -> None:
    ok = '{"choices":[{"message":{"content":"  A cat. "}}],"usage":{"prompt_tokens":5,"completion_tokens":3}}'
    assert parse_response(ok) == (CaptionResult("A cat."), {"prompt_tokens": 5, "completion_tokens": 3})
    parts = '{"choices":[{"message":{"content":[{"type":"text","text":"A dog."}]}}]}'
    assert parse_response(parts) == (CaptionResult("A dog."), None)
    assert parse_response('{"choices":[{"message":{"content":" "}}]}')[0].reason == "empty_caption"
    for bad in ("not json", "{}", '{"choices":[]}', '{"choices":[{"message":{"content":null}}]}', "[1]"):
        assert parse_response(bad)[0].reason == "bad_response", bad
    assert retry_after_seconds("2.5") == 2.5 and retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after_seconds("soon") is None


def test_request_shape_and_captions_match_local_model(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes]
) -> None:
    images = [photos[0], b"not an image", photos[1], photos[2]]
    captioner = build_captioner(config)
    results = captioner.caption_batch(images, [None] * len(images))
    assert results[1].reason == "decode_error:not_an_image"  # never sent
    assert [results[0], results[2], results[3]] == expected(local, [photos[0], photos[1], photos[2]])
    assert all(r.caption for r in (results[0], results[2], results[3])) and len({results[0].caption, results[2].caption}) == 2
    assert captioner.caption_batch(images, [None] * len(images)) == results  # deterministic

    bodies = fresh.stats.bodies
    assert len(bodies) == 6 and fresh.stats.requests == 6
    body = bodies[0]
    assert body["model"] == SERVED and body["max_tokens"] == 12 and body["temperature"] == 0.0 and body["top_p"] == 1.0
    (message,) = body["messages"]
    assert message["role"] == "user"
    image_part, text_part = message["content"]
    assert text_part == {"type": "text", "text": CAPTION_PROMPT}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/jpeg;base64,")
    sent = {base64.b64decode(b["messages"][0]["content"][0]["image_url"]["url"].split(",", 1)[1]) for b in bodies}
    assert sent == {encode_for_request(p, TINY_PIXELS) for p in photos}
    for data in sent:
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.width * image.height <= TINY_PIXELS

    assert captioner.usage["ok"] == 6 and captioner.usage["failed"] == 2 and captioner.usage["retries"] == 0
    assert captioner.usage["completion_tokens"] > 0 and captioner.usage["requests"] == 6
    assert captioner.last_usage[1] is None and captioner.last_usage[0]["completion_tokens"] > 0


def test_injected_429_and_5xx_are_retried(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes]
) -> None:
    fresh.faults = Faults(schedule=[429, 500, 503, 429, 502], retry_after=0.05)
    captioner = build_captioner(config)
    results = captioner.caption_batch(photos, [None] * 3)
    assert results == expected(local, photos)
    assert fresh.stats.faults == 5 and captioner.usage["retries"] == 5 and captioner.usage["requests"] == 8
    assert captioner.client.backoff(1, 0.3) >= 0.3 and captioner.client.backoff(20, None) <= 30.0  # Retry-After is a floor


def test_client_errors_are_not_retried(fresh: CaptionServer, config: CaptionerConfig, photos: list[bytes]) -> None:
    fresh.faults = Faults(schedule=[400])
    captioner = build_captioner(replace(config, concurrency=1))
    results = captioner.caption_batch(photos[:2], [None, None])
    assert results[0].error.startswith("http_error: 400 ") and "injected fault" in results[0].error
    assert results[1].caption and captioner.usage["requests"] == 2
    wrong = build_captioner(replace(config, model="not-served")).caption_batch(photos[:1], [None])
    assert wrong[0].error.startswith("http_error: 404 ")


def test_persistent_failures_are_recorded_then_a_rerun_completes_them(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes]
) -> None:
    images = photos + photos[:1]
    want = expected(local, images)
    # Every request fails with 500: each image tried 1 + max_retries times, then recorded.
    fresh.faults = Faults(rate=1.0, fault=500)
    captioner = build_captioner(replace(config, max_retries=2))
    failed = captioner.caption_batch(images, [None] * len(images))
    assert all(r.reason == "http_error" and r.error.startswith("http_error: 500 ") for r in failed)
    assert all("after 3 attempts" in r.error for r in failed) and fresh.stats.requests == 12
    # Some requests hang past the client's timeout: those images fail with `timeout`. The others
    # must answer within it on a loaded machine too (0.4 s failed in a suite run at load ~30): the
    # tiny model takes ~0.1 s idle, so 5 s separates a hang (15 s) from a slow answer.
    fresh.faults = Faults(schedule=["delay", None, "delay", None], delay_s=15)
    hasty = build_captioner(replace(config, timeout_s=5, max_retries=0, concurrency=1))
    mixed = hasty.caption_batch(images, [None] * len(images))
    assert [r.reason for r in mixed] == ["timeout", None, "timeout", None]
    assert mixed[0].error == "timeout: no answer within 5 s" and [mixed[1], mixed[3]] == [want[1], want[3]]
    # Nothing listens: connection errors, also recorded.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    refused = build_captioner(replace(config, endpoint=f"http://127.0.0.1:{closed}/v1", max_retries=1))
    assert [r.reason for r in refused.caption_batch(photos[:1], [None])] == ["connection_error"]
    # The rerun (what the next materialization does with the stored failures) completes them.
    fresh.faults = Faults()
    redo = [i for i, r in enumerate(mixed) if r.error]
    rerun = build_captioner(config).caption_batch([images[i] for i in redo], [None] * len(redo))
    assert rerun == [want[i] for i in redo]


def test_concurrency_bound_is_respected(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes]
) -> None:
    images = (photos * 3)[:8]
    fresh.faults = Faults(schedule=[503, None, 429], retry_after=0.0)
    results = build_captioner(replace(config, concurrency=2)).caption_batch(images, [None] * len(images))
    assert results == expected(local, images)  # input order kept
    assert fresh.stats.max_in_flight == 2 and max(fresh.stats.batches) <= 2
    fresh.stats = type(fresh.stats)()
    build_captioner(replace(config, concurrency=1)).caption_batch(images[:3], [None] * 3)
    assert fresh.stats.max_in_flight == 1 and set(fresh.stats.batches) == {1}


def test_caption_batch_callable_with_the_openai_backend(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes]
) -> None:
    fresh.faults = Faults(schedule=[500])
    batch = {"content_id": np.array(["a", "b", "c"], dtype=object),
             "image": np.array([photos[0], b"junk", np.frombuffer(photos[2], dtype=np.uint8)], dtype=object)}
    out = CaptionBatch(config)(batch)
    want = expected(local, [photos[0], photos[2]])
    assert list(out["caption"]) == [want[0].caption, "", want[1].caption]
    assert out["error"][0] == out["error"][2] == "" and out["error"][1].startswith("decode_error:")
    assert set(out["captioner_version"]) == {config.version()} and set(out["prompt_version"]) == {PROMPT_VERSION}
    assert set(out["captioner_id"]) == {f"openai:{SERVED}:{config.version()[:12]}"}


def test_server_reads_only_base64_data_urls() -> None:
    from prx_core.models.serving import first_image

    assert first_image({"messages": []}) == "expected messages with a user message holding an image_url part"
    assert first_image({"messages": [{"role": "user", "content": "hi"}]}) == "the user message holds no image_url part"
    url = {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}
    assert first_image({"messages": [{"role": "user", "content": [url]}]}) == "only base64 image data URLs are supported"
    good = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"abc").decode()}}
    assert first_image({"messages": [{"role": "user", "content": [good]}]}) == b"abc"


def test_captions_stage_records_endpoint_failures_and_a_rerun_completes_them(
    fresh: CaptionServer, config: CaptionerConfig, local: TransformersCaptioner, photos: list[bytes],
    tmp_path, monkeypatch: pytest.MonkeyPatch, ray_cluster,
) -> None:
    """build_captions with a real local Ray: CaptionBatch actors call the loopback server."""
    from prx_core.stages.captions import stage as captions_stage
    from prx_core.store import lance_io
    from prx_core.store.storage import Storage

    storage = Storage(str(tmp_path / "corpus"))
    write_contents(storage, "demo", {"c0": photos[0], "c1": photos[1], "c2": photos[2], "junk": b"not an image"})
    serial = replace(config, concurrency=1, max_retries=0, batch_size=4)
    fresh.faults = Faults(schedule=[500, 429])  # the first two images sent fail, with no retries left
    first = captions_stage.build_captions("demo", storage, serial)
    assert (first.captioned, first.failed, first.reused) == (1, 3, 0)
    assert first.failures == {"http_error": 2, "decode_error": 1}
    rerun = captions_stage.build_captions("demo", storage, serial)
    assert (rerun.reused, rerun.captioned, rerun.failed) == (1, 2, 1)
    want = dict(zip(["c0", "c1", "c2"], expected(local, photos[:3])))
    rows = {r["content_id"]: r for r in lance_io.open_table(storage.lance_uri("captions")).to_table().to_pylist()}
    assert {cid: rows[cid]["caption"] for cid in want} == {cid: r.caption for cid, r in want.items()}
    assert all(rows[cid]["error"] == "" and rows[cid]["captioner_version"] == serial.version() for cid in want)
    assert rows["junk"]["error"].startswith("decode_error") and fresh.stats.requests == 5
