"""The `vllm` captioner backend without vLLM, GPUs or weights: the exact processor config, the
exact request built from a row, the parsing of engine output rows, and the captions stage taking
the ray.data.llm path (with a stand-in for generation) into the same upsert."""

from __future__ import annotations

import base64
import importlib.util
import io
import os
from dataclasses import replace

import numpy as np
import pytest
from corpora import write_contents
from PIL import Image

from prx_core.compute.unit_results import read_detail
from prx_core.models import captioning_vllm as cv
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.captioning import build_captioner
from prx_core.models.engine_sizing import GPU_MEMORY_GB, MODEL_SHAPES, describe_sizing, size_engine
from prx_core.models.prompts import CAPTION_PROMPT, PROMPT_VERSION
from prx_core.stages.captions import stage as captions_stage
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io
from prx_core.store.storage import Storage

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no Hub access: build_processor must cope offline

MODEL = "Qwen/Qwen3-VL-8B-Instruct"
HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray 2.60's worker start runs the module it names


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def decode_data_url(url: str) -> Image.Image:
    prefix = "data:image/jpeg;base64,"
    assert url.startswith(prefix)
    return Image.open(io.BytesIO(base64.b64decode(url[len(prefix):])))


@pytest.fixture(scope="module")
def config() -> CaptionerConfig:
    return CaptionerConfig(
        "vllm", model=MODEL, max_new_tokens=300, temperature=0.7, top_p=0.9, max_pixels=448 * 448, batch_size=32,
        tensor_parallel_size=2, replicas=3, max_model_len=8192, accelerator_type="H200",
        engine_kwargs={"gpu_memory_utilization": 0.85, "max_num_seqs": 512}, runtime_env={"env_vars": {"X": "1"}},
        size_from_gpu=False,  # the plumbing as configured (the sizing: test_engines_are_sized_from_the_gpus_memory)
    )


def test_vllm_is_not_installed_here() -> None:
    """Here: the pipeline's environment. The engine runs from the vLLM test environment (tests/e2e/test_vllm_*)."""
    assert importlib.util.find_spec("vllm") is None


def test_a_cpu_accelerator_places_engines_on_cpu_bundles(config: CaptionerConfig) -> None:
    """`accelerator_type: CPU` (the vLLM test environment): no GPU asked for, the engine on half a
    CPU and every CPU stage on a tenth, so the pipeline's tasks still find a CPU on a small Ray."""
    cpu = cv.build_vllm_processor_config(replace(config, accelerator_type="cpu", tensor_parallel_size=1))
    assert cpu.accelerator_type is None and cpu.placement_group_config["bundles"] == [{"CPU": 0.5, "GPU": 0.0}]
    assert cpu.prepare_multimodal_stage == {"enabled": True, "num_cpus": cv.CPU_STAGE_CPUS}
    for stage in ("chat_template_stage", "tokenize_stage", "detokenize_stage"):
        assert getattr(cpu, stage) == {"enabled": True, "num_cpus": cv.CPU_STAGE_CPUS}, stage
    gpu = cv.build_vllm_processor_config(config)
    assert gpu.placement_group_config is None and gpu.chat_template_stage is True


def test_processor_config_has_the_exact_fields(config: CaptionerConfig) -> None:
    processor_config = cv.build_vllm_processor_config(config)
    assert processor_config.model_source == MODEL
    assert processor_config.batch_size == 32
    assert processor_config.concurrency == 3
    assert processor_config.accelerator_type == "H200"
    assert processor_config.runtime_env == {"env_vars": {"X": "1", HOOK_VAR: "prx_core.models.vllm_compat.install"}}
    assert config.runtime_env == {"env_vars": {"X": "1"}}  # the config's own dict is never mutated
    assert processor_config.prepare_multimodal_stage == {"enabled": True}
    assert processor_config.should_continue_on_error is True
    assert processor_config.engine_kwargs == {
        "tensor_parallel_size": 2, "max_model_len": 8192, "limit_mm_per_prompt": {"image": 1},
        "mm_processor_kwargs": {"max_pixels": 448 * 448}, "gpu_memory_utilization": 0.85, "max_num_seqs": 512,
        "task_type": "generate",  # added by Ray's validator
    }
    assert "task_type" not in config.engine_kwargs  # the config's own dict is never mutated
    # engine_kwargs override ours
    overridden = replace(config, engine_kwargs={"mm_processor_kwargs": {"max_pixels": 1024 * 1024}})
    assert cv.build_vllm_processor_config(overridden).engine_kwargs["mm_processor_kwargs"] == {"max_pixels": 1024 * 1024}
    with pytest.raises(ValueError, match="vllm backend"):
        cv.build_vllm_processor_config(CaptionerConfig("source"))


def test_build_processor_succeeds_without_vllm(config: CaptionerConfig, ray_cluster) -> None:
    processor = cv.build_vllm_processor(config)
    assert processor.list_stage_names() == [
        "PrepareMultimodalStage", "ChatTemplateStage", "TokenizeStage", "vLLMEngineStage", "DetokenizeStage"]
    engine = processor.get_stage_by_name("vLLMEngineStage")
    assert engine.fn_constructor_kwargs["model"] == MODEL
    assert engine.fn_constructor_kwargs["batch_size"] == 32
    assert engine.fn_constructor_kwargs["should_continue_on_error"] is True
    assert engine.fn_constructor_kwargs["engine_kwargs"]["distributed_executor_backend"] == "ray"  # tp 2
    assert engine.map_batches_kwargs["accelerator_type"] == "H200"
    assert engine.map_batches_kwargs["compute"].max_size == 3


def test_config_validation_version_and_no_per_batch_captioner(config: CaptionerConfig) -> None:
    with pytest.raises(ValueError, match="needs `model`"):
        CaptionerConfig("vllm")
    with pytest.raises(ValueError, match="at least 1"):
        replace(config, replicas=0)
    with pytest.raises(ValueError, match="runs as a whole Ray Data stage"):
        build_captioner(config)
    assert config.captioner_id() == f"vllm:Qwen3-VL-8B-Instruct:{config.version()[:12]}"
    assert config.version_inputs()["model"] == f"hub:{MODEL}"
    same = [replace(config, replicas=8), replace(config, batch_size=4), replace(config, tensor_parallel_size=1),
            replace(config, accelerator_type=None, runtime_env={}, max_model_len=4096),
            replace(config, engine_kwargs={"gpu_memory_utilization": 0.5})]
    assert {c.version() for c in same} == {config.version()}
    changed = [replace(config, model="Qwen/Qwen3-VL-4B-Instruct"), replace(config, prompt_version="caption-v2"),
               replace(config, temperature=0.2), replace(config, top_p=0.8), replace(config, max_new_tokens=200),
               replace(config, max_pixels=512 * 512), replace(config, engine_kwargs={"dtype": "float16"}),
               replace(config, engine_kwargs={"revision": "abc123"})]
    versions = {c.version() for c in changed}
    assert len(versions) == len(changed) and config.version() not in versions
    hash(config)  # engine_kwargs/runtime_env dicts do not make the frozen config unhashable


def test_preprocess_builds_the_exact_request(config: CaptionerConfig) -> None:
    request = cv.Preprocess(config)({"content_id": "c1", "image": jpeg(1600, 1000), "original_caption": "x"})
    assert set(request) == {"content_id", "image", "decode_error", "messages", "sampling_params"}
    assert request["content_id"] == "c1" and request["image"] == b"" and request["decode_error"] == ""
    assert request["sampling_params"] == {"max_tokens": 300, "temperature": 0.7, "top_p": 0.9, "detokenize": False}
    [message] = request["messages"]
    assert message["role"] == "user"
    image_part, text_part = message["content"]
    assert text_part == {"type": "text", "text": CAPTION_PROMPT}
    assert set(image_part) == {"type", "image_url"} and image_part["type"] == "image_url"
    image = decode_data_url(image_part["image_url"]["url"])
    assert image.format == "JPEG" and image.mode == "RGB"
    assert image.width * image.height <= 448 * 448 and image.width / image.height == pytest.approx(1.6, rel=0.01)
    # greedy: top_p is not sent as set
    greedy = cv.Preprocess(replace(config, temperature=0.0))({"content_id": "c1", "image": jpeg(64, 64)})
    assert greedy["sampling_params"] == {"max_tokens": 300, "temperature": 0.0, "top_p": 1.0, "detokenize": False}
    # the retry of a refused caption: the config's fallback decoding, as the other backends decode it
    fallback = cv.Preprocess(config, fallback=True)({"content_id": "c1", "image": jpeg(64, 64)})
    assert fallback["sampling_params"] == {"max_tokens": 300, "temperature": 0.0, "top_p": 1.0, "detokenize": False,
                                           "repetition_penalty": config.fallback_repetition_penalty}
    sampled = cv.Preprocess(replace(config, fallback_temperature=0.3, fallback_repetition_penalty=1.0), fallback=True)
    assert sampled({"content_id": "c1", "image": jpeg(64, 64)})["sampling_params"] == {
        "max_tokens": 300, "temperature": 0.3, "top_p": 0.9, "detokenize": False, "seed": 0}
    # a numpy uint8 cell (Ray numpy batches) and a small image kept at its size
    small = cv.Preprocess(config)({"content_id": "c2", "image": np.frombuffer(jpeg(64, 48), np.uint8)})
    assert decode_data_url(small["messages"][0]["content"][0]["image_url"]["url"]).size == (64, 48)


@pytest.mark.parametrize("data", [b"", b"not an image", jpeg(200, 200)[:300], None])
def test_a_corrupt_image_becomes_an_error_row_not_an_exception(config: CaptionerConfig, data) -> None:
    request = cv.Preprocess(config)({"content_id": "bad", "image": data})
    assert request["decode_error"].startswith("decode_error")
    assert request["sampling_params"]["max_tokens"] == 1
    assert request["messages"] == [{"role": "user", "content": [{"type": "text", "text": "."}]}]
    row = cv.Postprocess(config)({**request, "generated_text": "x", "num_generated_tokens": 1})
    assert row["error"] == request["decode_error"] and row["caption"] == "" and row["word_count"] == 0
    assert row["num_generated_tokens"] == 0


def test_postprocess_maps_engine_rows_to_caption_rows(config: CaptionerConfig) -> None:
    post = cv.Postprocess(config)
    base = {"content_id": "c1", "decode_error": "", "prompt": "...", "num_input_tokens": 500}
    ok = post({**base, "generated_text": "  A photograph of a red\n\nbrick wall.  ", "num_generated_tokens": 9,
               "time_taken_llm": 0.25})
    assert ok == {
        "content_id": "c1", "caption": "A photograph of a red brick wall.", "captioner_id": config.captioner_id(),
        "captioner_version": config.version(), "prompt_version": PROMPT_VERSION, "word_count": 7, "error": "",
        "num_generated_tokens": 9, "num_input_tokens": 500, "finish_reason": "stop", "llm_seconds": 0.25,
    }
    # the whole token budget used: vLLM stopped it for length (Ray 2.60 does not pass vLLM's reason on)
    capped = post({**base, "generated_text": "word " * 300, "num_generated_tokens": config.max_new_tokens})
    assert capped["finish_reason"] == "length" and capped["llm_seconds"] == 0.0  # no time reported
    assert tuple(ok) == cv.OUTPUT_COLUMNS
    empty = post({**base, "generated_text": " \n", "num_generated_tokens": 1})
    assert empty["error"] == "empty_caption: the model generated no text" and empty["caption"] == ""
    missing = post(base)
    assert missing["error"].startswith("generation_error: ") and missing["word_count"] == 0
    assert (missing["num_generated_tokens"], missing["num_input_tokens"], missing["finish_reason"]) == (0, 0, "")
    # an engine failure bypasses postprocess inside Ray; Finalize turns the raw row into an error row
    failed = cv.Finalize(config)({**base, "generated_text": "", "__inference_error__": "ValueError: too long"})
    assert failed["error"] == "generation_error: ValueError: too long" and failed["content_id"] == "c1"
    assert tuple(failed) == cv.OUTPUT_COLUMNS
    assert cv.Finalize(config)({**ok, "__inference_error__": "", "extra": 1}) == ok
    # a raw row Ray let through with a null __inference_error__ is postprocessed here
    raw = {**base, "generated_text": "A photograph of a red brick wall.", "num_generated_tokens": 9, "__inference_error__": None,
           "time_taken_llm": 0.25}
    assert cv.Finalize(config)(raw) == ok


class FakeProcessor:
    """build_processor's shape with Ray's own pre/postprocess wrappers; generation is a stand-in
    that reads the image the request carries (its size) instead of running a model: an 11-word
    line (the checks refuse it: too short), and under the fallback decoding a paragraph for an
    image wider than 1000 pixels."""

    def __init__(self, config: CaptionerConfig, fallback: bool = False) -> None:
        from ray.llm._internal.batch.processor.base import Processor

        def generate(row: dict) -> dict:
            request = cv.Preprocess(config, fallback)(row)
            part = request["messages"][0]["content"][0]
            if part["type"] != "image_url":
                return {**request, "generated_text": "", "num_generated_tokens": 0, "__inference_error__": ""}
            if row["content_id"] == "engine-fails":
                return {**request, "__inference_error__": "RuntimeError: CUDA error"}
            width, height = decode_data_url(part["image_url"]["url"]).size
            text = f"A photograph {width} pixels wide and {height} pixels high showing noise."
            if "repetition_penalty" in request["sampling_params"] and width > 500:
                text += (" Speckles of red, green and blue grain cover the frame from edge to edge without any"
                         " visible subject, horizon or shape; bright and dark dots alternate at random, the texture"
                         " looks like an old television tuned between channels, and nothing in it can be named.")
            return {**request, "generated_text": text, "num_generated_tokens": len(text.split()) + 3,
                    "__inference_error__": ""}  # as vLLMEngineStage sets it on every row

        self.processor = Processor(cv.build_vllm_processor_config(config), [], preprocess=generate,
                                   postprocess=cv.Postprocess(config))

    def __call__(self, dataset):
        return self.processor(dataset)


def test_captions_stage_takes_the_vllm_path_over_the_same_units(
    config: CaptionerConfig, ray_cluster, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    images = {"c0": jpeg(1600, 1000, 0), "c1": jpeg(300, 200, 1), "corrupt": b"\xff\xd8junk", "engine-fails": jpeg(64, 64, 2)}
    write_contents(storage, "demo", images, {"c0": "a", "corrupt": "b", "engine-fails": "c"})

    built: list[tuple[CaptionerConfig, bool]] = []

    def factory(cfg: CaptionerConfig, fallback: bool = False):
        built.append((cfg, fallback))
        return FakeProcessor(cfg, fallback)

    def no_caption_batch(*args, **kwargs):
        raise AssertionError("the vllm backend must not use CaptionBatch")

    monkeypatch.setattr(cv, "build_vllm_processor", factory)
    monkeypatch.setattr(captions_stage, "CaptionBatch", no_caption_batch)
    report = captions_stage.build_captions("demo", storage, config)
    # the first pipeline, then one with the fallback decoding for the two captions the checks refused
    assert built == [(config, False), (config, True)]
    assert (report.captioned, report.failed, report.reused, report.fallbacks) == (2, 2, 0, 2)
    assert report.failures == {"decode_error": 1, "generation_error": 1}
    assert report.quality == {"retried:too_short": 1, "rejected:too_short": 1}
    ok_words = [r["word_count"] for r in lance_io.open_table(storage.lance_uri("captions")).to_table().to_pylist()
                if not r["error"]]
    assert report.output_tokens == 2 * (11 + 3) + sum(w + 3 for w in ok_words)  # both attempts' tokens
    assert report.gpu_hours == pytest.approx(
        report.generation_seconds * config.replicas * config.tensor_parallel_size / 3600)
    rows = {r["content_id"]: r for r in lance_io.open_table(storage.lance_uri("captions")).to_table().to_pylist()}
    assert set(rows) == set(images)
    assert all(r["captioner_version"] == config.version() and r["captioner_id"] == config.captioner_id()
               and r["prompt_version"] == PROMPT_VERSION for r in rows.values())
    assert rows["c0"]["caption"].startswith("A photograph 566 pixels wide and 354 pixels high showing noise. Speckles")
    assert 566 * 354 <= 448 * 448 and rows["c0"]["error"] == "" and rows["c0"]["word_count"] == 11 + 45
    assert (rows["c0"]["verdict"], rows["c0"]["problem"], rows["c0"]["attempts"]) == ("retried", "too_short", 2)
    assert rows["c1"]["caption"].startswith("A photograph 300 pixels wide and 200")
    assert (rows["c1"]["verdict"], rows["c1"]["problem"], rows["c1"]["attempts"]) == ("rejected", "too_short", 2)
    assert rows["corrupt"]["error"].startswith("decode_error") and rows["corrupt"]["caption"] == ""
    assert rows["engine-fails"]["error"] == "generation_error: RuntimeError: CUDA error"
    # a rerun keeps the captions and retries only the failures
    again = captions_stage.build_captions("demo", storage, config)
    assert (again.reused, again.captioned, again.failed) == (2, 0, 2)


def test_units_not_prepared_ahead_are_prepared_by_the_pipeline(
    config: CaptionerConfig, ray_cluster, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-CPU Ray one unit is prepared ahead (it has work: the engines may start), the other
    five as the pipeline's input stage; every caption is made once, and a forced rerun, with
    everything stored, prepares every unit ahead and builds no engine at all."""
    storage = Storage(str(tmp_path / "corpus"))
    images = {f"c{i}": jpeg(320 + 16 * i, 240, i) for i in range(6)}
    write_contents(storage, "demo", images, {k: "x" for k in images})
    built: list[bool] = []

    def factory(cfg: CaptionerConfig, fallback: bool = False):
        built.append(fallback)
        return FakeProcessor(cfg, fallback)

    monkeypatch.setattr(cv, "build_vllm_processor", factory)
    report = captions_stage.build_captions("demo", storage, config, unit_rows=1)
    detail = read_detail(storage, report.units.detail_uri)  # in plan order
    assert len(detail) == 6 and report.units.ran == 6
    assert [s.get("prepared_in") for s in detail] == [None] + ["pipeline"] * 5
    assert all(s["todo"] == s["generated"] == 1 for s in detail) and report.captioned == 6
    ids = lance_io.open_table(storage.lance_uri("captions")).to_table(columns=["content_id"])["content_id"].to_pylist()
    assert sorted(ids) == sorted(images)
    built.clear()
    assert force_next_run(storage, "captions", "demo")
    again = captions_stage.build_captions("demo", storage, config, unit_rows=1)
    assert (again.reused, again.captioned, built) == (6, 0, [])


def test_engines_are_sized_from_the_gpus_memory(config: CaptionerConfig) -> None:
    """docs/captioning.md's table: Qwen3-VL-8B at 896x896 pixels and 320 new tokens is ~1,200
    tokens, 0.18 GB of KV cache a request; an H100 holds 261 such requests, an H200 571, and Ray
    Data's batches (8 in flight per engine) are sized to keep them full."""
    shape = MODEL_SHAPES[MODEL]
    h100, h200 = (size_engine(shape, GPU_MEMORY_GB[g], max_pixels=802816, max_new_tokens=320) for g in ("H100", "H200"))
    assert (h100.tokens_per_request, h100.kv_gb_per_request) == (784 + 100 + 320, 0.1775)
    assert (h100.max_num_seqs, h100.batch_size, h200.max_num_seqs, h200.batch_size) == (261, 41, 571, 90)
    assert size_engine(shape, 80.0, max_pixels=802816, max_new_tokens=320, tensor_parallel_size=2).max_num_seqs > 2 * 261
    with pytest.raises(ValueError, match="does not fit"):
        size_engine(replace(shape, weight_gb=80.0), 80.0, max_pixels=802816, max_new_tokens=320)
    production = replace(config, size_from_gpu=True, engine_kwargs={}, tensor_parallel_size=1, max_pixels=802816,
                         max_new_tokens=320)
    processor = cv.build_vllm_processor_config(production)
    assert (processor.batch_size, processor.engine_kwargs["max_num_seqs"]) == (90, 571)
    kept = cv.build_vllm_processor_config(replace(production, batch_size=128, engine_kwargs={"max_num_seqs": 256}))
    assert (kept.batch_size, kept.engine_kwargs["max_num_seqs"]) == (128, 256)  # never smaller than asked, seqs as given
    for unsized, why in ((replace(production, accelerator_type="T4"), "no known memory for accelerator_type 'T4'"),
                         (replace(production, model="org/other-vlm"), "no known shape for org/other-vlm"),
                         (replace(production, size_from_gpu=False), "size_from_gpu: false")):
        processor = cv.build_vllm_processor_config(unsized)
        assert processor.batch_size == config.batch_size and "max_num_seqs" not in processor.engine_kwargs
        assert describe_sizing(unsized) == f"vLLM engines: batch_size 32 and engine_kwargs as configured ({why}; " \
                                           "docs/captioning.md)"
    assert describe_sizing(production) == (  # what `prx-corpus plan` prints
        f"vLLM engines of {MODEL} on H200 x 1: 571 requests at once (1,204-token requests, 0.18 GB of KV cache each, "
        "101.4 GB of cache), batches of 90")
