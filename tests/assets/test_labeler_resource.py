"""LabelerResource fields reach LabelerConfig, and the ones that change labels change the
caption_labels code_version (the llm settings of PRX_CONFIG are otherwise unreachable)."""

from __future__ import annotations

import pytest

from prx_assets.caption_labels import caption_labels_asset
from prx_resources import CaptionerResource, LabelerResource

LLM = {"backend": "llm", "model": "Qwen/Qwen3-8B", "endpoint": "http://qwen:8000/v1"}


def code_version(labeler: LabelerResource) -> str:
    asset = caption_labels_asset(CaptionerResource(), labeler)
    return asset.code_versions_by_key[asset.key]


def test_vllm_transport_fields_reach_the_config() -> None:
    config = LabelerResource(backend="llm", model="Qwen/Qwen3-8B", transport="vllm", replicas=4, tensor_parallel_size=2,
                             max_model_len=1024, accelerator_type="H200", engine_kwargs={"dtype": "bfloat16"},
                             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}}).config()
    assert (config.transport, config.replicas, config.tensor_parallel_size, config.max_model_len,
            config.accelerator_type) == ("vllm", 4, 2, 1024, "H200")
    assert dict(config.engine_kwargs) == {"dtype": "bfloat16"} and config.thinking is False


@pytest.mark.parametrize("change, stale", [
    ({"thinking": True}, True), ({"thinking": None}, True), ({"max_tokens": 8}, True),
    ({"concurrency": 3}, False), ({"timeout_s": 5.0}, False),
])
def test_code_version_follows_what_changes_labels(change: dict, stale: bool) -> None:
    assert (code_version(LabelerResource(**LLM, **change)) != code_version(LabelerResource(**LLM))) == stale


def test_minilm_version_ignores_llm_only_fields() -> None:
    assert code_version(LabelerResource(thinking=True)) == code_version(LabelerResource())


def test_minilm_method_reaches_the_config_and_the_code_version() -> None:
    head, similarity = LabelerResource().config(), LabelerResource(method="similarity").config()
    assert (head.method, similarity.method) == ("head", "similarity")
    assert (similarity.text_threshold, similarity.nsfw_threshold) == (0.33, 0.45)  # cosines, not the head's
    assert code_version(LabelerResource(method="similarity")) != code_version(LabelerResource())
    assert code_version(LabelerResource(method="head")) == code_version(LabelerResource())


def test_explicit_terms_reach_the_config_and_the_code_version() -> None:
    assert LabelerResource().config().explicit_terms is True  # the head's default
    assert LabelerResource(explicit_terms=False).config().explicit_terms is False
    assert LabelerResource(method="similarity").config().explicit_terms is False
    assert code_version(LabelerResource(explicit_terms=False)) != code_version(LabelerResource())
    assert code_version(LabelerResource(explicit_terms=True)) == code_version(LabelerResource())


def test_the_deploy_example_config_builds_valid_resources() -> None:
    from pathlib import Path

    from prx_assets.definitions import build_resources
    from prx_assets.settings import load_settings

    example = Path(__file__).resolve().parents[2] / "deploy" / "prx-config.gpu.yaml"
    resources = build_resources(load_settings({"PRX_CONFIG": str(example)}))
    captioner, labeler = resources["captioner"].config(), resources["labeler"].config()
    assert (captioner.backend, captioner.accelerator_type) == ("vllm", "H200")
    assert (labeler.backend, labeler.transport, labeler.thinking) == ("llm", "openai", False)


@pytest.mark.parametrize("labeler, pool", [
    (LabelerResource(), None),  # MiniLM on CPUs
    (LabelerResource(**LLM), None),  # an external endpoint: no GPU of the cluster
    (LabelerResource(**LLM, transport="vllm"), "gpu"),  # vLLM on the GPU workers, beside the captioner
])
def test_labels_take_the_gpu_pool_only_on_gpu_workers(labeler: LabelerResource, pool: str | None) -> None:
    asset = caption_labels_asset(CaptionerResource(), labeler)
    assert asset.op.pool == pool
