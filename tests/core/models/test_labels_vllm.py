"""The llm labeller's `vllm` transport without vLLM, GPUs or weights: the exact processor config
(chat_template_kwargs reaching Ray's ChatTemplateStage), the exact request built from a row, the
parsing of engine output rows, and `build_labels` taking the ray.data.llm path (Ray's own
Processor wrappers, a stand-in for generation) into the same upsert, a rerun completing failures."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
from corpora import stored_labels, write_captions, write_contents

from prx_core.models import labels_vllm as lv
from prx_core.models.label_base import LABELS, LabelerConfig
from prx_core.models.labels_llm import LABEL_INSTRUCTION, error_code
from prx_core.stages import labels as stage
from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no Hub access: build_processor must cope offline

MODEL = "Qwen/Qwen3-8B"
THINKING_OFF = {"enabled": True, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def config() -> LabelerConfig:
    return LabelerConfig(
        backend="llm", model=MODEL, transport="vllm", max_tokens=4, batch_size=64, replicas=3,
        tensor_parallel_size=2, max_model_len=1024, accelerator_type="H200",
        engine_kwargs={"gpu_memory_utilization": 0.5, "max_model_len": 512}, runtime_env={"env_vars": {"X": "1"}},
    )


def test_vllm_is_not_installed_here() -> None:
    assert importlib.util.find_spec("vllm") is None


def test_processor_config_has_the_exact_fields(config: LabelerConfig) -> None:
    processor_config = lv.build_vllm_processor_config(config)
    assert (processor_config.model_source, processor_config.batch_size, processor_config.concurrency) == (MODEL, 64, 3)
    assert processor_config.accelerator_type == "H200" and processor_config.runtime_env == {
        "env_vars": {"X": "1", "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "prx_core.models.vllm_compat.install"}}
    assert processor_config.should_continue_on_error is True
    assert processor_config.chat_template_stage == THINKING_OFF  # Qwen3: no <think> block
    assert processor_config.prepare_multimodal_stage is False  # text only
    assert processor_config.engine_kwargs == {  # config.engine_kwargs override ours
        "tensor_parallel_size": 2, "max_model_len": 512, "gpu_memory_utilization": 0.5, "task_type": "generate"}
    thinking = lv.build_vllm_processor_config(replace(config, thinking=True)).chat_template_stage
    assert thinking == {"enabled": True, "chat_template_kwargs": {"enable_thinking": True}}
    assert lv.build_vllm_processor_config(replace(config, thinking=None)).chat_template_stage is True  # template default
    with pytest.raises(ValueError, match="transport vllm"):
        lv.build_vllm_processor_config(replace(config, transport="openai"))


def test_build_processor_succeeds_without_vllm(config: LabelerConfig, ray_cluster) -> None:
    processor = lv.build_vllm_processor(config)
    assert processor.list_stage_names() == ["ChatTemplateStage", "TokenizeStage", "vLLMEngineStage", "DetokenizeStage"]
    template = processor.get_stage_by_name("ChatTemplateStage").fn_constructor_kwargs
    assert template["model"] == MODEL and template["chat_template_kwargs"] == {"enable_thinking": False}
    engine = processor.get_stage_by_name("vLLMEngineStage")
    assert engine.fn_constructor_kwargs["model"] == MODEL and engine.fn_constructor_kwargs["should_continue_on_error"]
    assert engine.map_batches_kwargs["accelerator_type"] == "H200" and engine.map_batches_kwargs["compute"].max_size == 3


def test_version_follows_output_not_placement(config: LabelerConfig) -> None:
    same = [replace(config, replicas=8), replace(config, tensor_parallel_size=1, accelerator_type=None),
            replace(config, runtime_env={}, max_model_len=4096, batch_size=8),
            replace(config, engine_kwargs={"gpu_memory_utilization": 0.9}),
            replace(config, constrained="json_schema")]  # the vllm transport always constrains to the labels
    assert {c.version() for c in same} == {config.version()}
    changed = [replace(config, engine_kwargs={"dtype": "float16"}), replace(config, engine_kwargs={"revision": "abc"}),
               replace(config, thinking=True), replace(config, model="Qwen/Qwen3-4B"), replace(config, max_tokens=8)]
    assert len({c.version() for c in changed} | {config.version()}) == len(changed) + 1
    assert config.labeler_id() == f"llm:{config.version()[:12]}"


def test_preprocess_builds_the_exact_request(config: LabelerConfig) -> None:
    request = lv.vllm_preprocess(config)({"content_id": "c1", "caption": "A scanned invoice."})
    assert request == {
        "content_id": "c1", "caption": "A scanned invoice.",
        "messages": [{"role": "system", "content": LABEL_INSTRUCTION}, {"role": "user", "content": "A scanned invoice."}],
        "sampling_params": {"temperature": 0.0, "max_tokens": 4, "structured_outputs": {"choice": list(LABELS)}},
    }
    assert lv.vllm_preprocess(config)({"content_id": "c2", "caption": None})["messages"][1]["content"] == ""


def test_postprocess_and_finalize_map_engine_rows_to_label_rows(config: LabelerConfig) -> None:
    post = lv.vllm_postprocess(config)
    ok = post({"content_id": "c1", "caption": "x", "generated_text": " Text.\n", "messages": []})
    assert ok == {"content_id": "c1", "label": "text", "score": 1.0, "labeler_id": config.labeler_id(),
                  "labeler_version": config.version(), "error": ""}
    assert tuple(ok) == lv.LABEL_COLUMNS
    assert post({"content_id": "c1", "caption": "x", "generated_text": "<think>\n\n</think>\n\nnsfw"})["label"] == "nsfw"
    bad = post({"content_id": "c2", "caption": "x", "generated_text": "text, nsfw"})
    assert bad["label"] == "" and error_code(bad["error"]) == "unparseable"
    assert error_code(post({"content_id": "c3", "caption": "x"})["error"]) == "bad_response"
    blank = post({"content_id": "c4", "caption": "  ", "generated_text": "whatever"})
    assert (blank["label"], blank["score"], blank["error"]) == ("visual", 0.0, "")
    # a row the engine failed bypasses postprocess inside Ray; the finalize map gives it the label columns
    finalize = lv.captioning_vllm.FinalizeRows(post, lv.LABEL_COLUMNS, "label")
    failed = finalize({"content_id": "c5", "caption": "x", "generated_text": "", "__inference_error__": "OOM"})
    assert failed["error"] == "generation_error: OOM" and failed["label"] == "" and tuple(failed) == lv.LABEL_COLUMNS
    assert finalize({**ok, "__inference_error__": "", "prompt": "..."}) == ok
    raw = {"content_id": "c1", "caption": "x", "generated_text": "text", "__inference_error__": None}
    assert finalize(raw) == ok  # Ray let a raw row through (null error column): postprocessed here


def stand_in_processor(config: LabelerConfig, answers: dict[str, str | None]):
    """Ray's own Processor (pre/postprocess wrappers, error rows bypassing postprocess) with no
    stages: generation is a stand-in answering by caption from `answers` (None: the engine fails)."""
    from ray.llm._internal.batch.processor.base import Processor

    preprocess = lv.vllm_preprocess(config)

    def generate(row: dict) -> dict:
        request = preprocess(row)
        answer = answers[request["caption"]]
        if answer is None:
            return {**request, "__inference_error__": "RuntimeError: CUDA error"}
        return {**request, "generated_text": answer, "num_generated_tokens": 2, "__inference_error__": ""}

    return Processor(lv.build_vllm_processor_config(config), [], preprocess=generate, postprocess=lv.vllm_postprocess(config))


def test_labels_stage_takes_the_vllm_path_over_the_same_units(
    config: LabelerConfig, ray_cluster, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = ["a beach", "an invoice", "explicit", "rambling", "engine fails"]
    ids = [f"c{i}" for i in range(5)]
    first = {"a beach": "visual", "an invoice": "<think>\n\n</think>\n\ntext", "explicit": "nsfw",
             "rambling": "It is visual, or maybe text.", "engine fails": None}
    runs = [first, {**first, "rambling": "visual", "engine fails": "nsfw"}]
    built: list[LabelerConfig] = []

    def factory(cfg: LabelerConfig):
        built.append(cfg)
        return stand_in_processor(cfg, runs[len(built) - 1])

    def no_label_batch(*args, **kwargs):
        raise AssertionError("the vllm transport must not use LabelBatch")

    monkeypatch.setattr(lv, "build_vllm_processor", factory)
    monkeypatch.setattr(stage, "LabelBatch", no_label_batch)
    storage = Storage(str(tmp_path / "corpus"))
    write_contents(storage, "demo", {c: c.encode() for c in ids})
    write_captions(storage, "cap-v1", dict(zip(ids, texts)))

    report = stage.build_labels("demo", storage, "cap-v1", config, unit_rows=2)  # 3 units
    assert built == [config]
    assert (report.captioned, report.reused, report.labelled, report.failed) == (5, 0, 5, 2)
    assert report.failures == {"unparseable": 1, "generation_error": 1}
    assert report.gpu_hours is not None and report.gpu_hours > 0  # replicas x GPUs x labelling time
    assert report.distribution == {"visual": 1, "text": 1, "nsfw": 1}
    stored = stored_labels(storage, config)
    assert dict(zip(stored["content_id"].to_pylist(), stored["label"].to_pylist())) == {
        "c0": "visual", "c1": "text", "c2": "nsfw"}
    assert set(stored["labeler_id"].to_pylist()) == {config.labeler_id()}

    again = stage.build_labels("demo", storage, "cap-v1", config)  # only the two failures go back to the engine
    assert (again.reused, again.labelled, again.failed, again.failures) == (3, 2, 0, {})
    assert again.distribution == {"visual": 2, "text": 1, "nsfw": 2}
    done = stage.build_labels("demo", storage, "cap-v1", config)  # unchanged: `again` stands, nothing runs
    assert (done.reused, done.labelled) == (3, 2) and len(built) == 2
    assert force_next_run(storage, "caption_labels", "demo")  # forced: every label found stored
    done = stage.build_labels("demo", storage, "cap-v1", config)
    assert (done.reused, done.labelled) == (5, 0) and len(built) == 2  # nothing left: no processor built
