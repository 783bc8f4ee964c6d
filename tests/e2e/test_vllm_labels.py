"""The `llm` labeller's `vllm` transport through the real engine: `label_dataset`, the Ray Data
pipeline `caption_labels` runs on that transport (chat template, tokenize, engine with the answer
constrained to the labels, detokenize, the strict parser), on vLLM's CPU build from the vLLM test
environment, serving the tiny random Qwen2-VL as a text model. One engine (~1-1.5 min to start)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_engine import engine_python

from prx_core.models.label_base import LABELS, LabelerConfig
from prx_core.models.labels_vllm import label_dataset
from prx_core.models.tiny_vlm import build_tiny_qwen2_vl
from prx_core.models.vllm_cpu import cpu_engine_settings

pytestmark = pytest.mark.slow

CAPTIONS = ["A red brick wall in the sun, moss between the bricks.", "A scanned invoice: a table of prices and a total.",
            "Two people on a beach at dusk.", ""]


@pytest.fixture(scope="module")
def ray_two_cpus() -> Iterator[object]:
    """A local Ray of two CPUs: what the CPU engine placement is sized for."""
    import ray

    from prx_core.compute.quiet import start_ray

    if ray.is_initialized():
        ray.shutdown()
    start_ray(num_cpus=2, log_to_driver=False)  # on loopback, as a build's: vLLM must agree on the node IP
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def test_every_caption_gets_one_of_the_labels(tmp_path_factory: pytest.TempPathFactory, ray_two_cpus) -> None:
    ray = ray_two_cpus
    checkpoint = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")
    config = LabelerConfig(backend="llm", transport="vllm", model=str(checkpoint), max_tokens=4,
                           **cpu_engine_settings(engine_python()))
    rows = [{"content_id": f"c{i}", "caption": text, "unit_id": "u1"} for i, text in enumerate(CAPTIONS)]
    labelled = label_dataset(ray.data.from_items(rows), config, carry=("unit_id",)).take_all()
    out = {row["content_id"]: row for row in labelled}
    assert sorted(out) == [row["content_id"] for row in rows]
    for row in labelled:
        # the engine may only answer one of the labels (structured outputs), and the parser takes it as is
        assert row["label"] in LABELS and row["error"] == "", row
        assert row["labeler_id"] == config.labeler_id() and row["unit_id"] == "u1"
    assert (out["c3"]["label"], out["c3"]["score"]) == ("visual", 0.0)  # a blank caption: visual, no model answer
