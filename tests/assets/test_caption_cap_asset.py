"""The caption cap through Dagster (issue 15, item 8): `samples` materialized on a folder source
with hostile sidecar captions stores them cleaned and capped and reports how many were, and the
cap (captioner.max_caption_chars) is part of the code versions of exactly the assets it changes."""

from __future__ import annotations

from pathlib import Path

from demo_corpus import image_folder_source, read
from materializing import fresh_instance, make_settings, materialize, materialized

from prx_assets.definitions import build_assets, build_resources
from prx_core.models.caption_text import clean_caption
from prx_core.sources.catalog import load_catalog

CAPTION_DEPENDENT = {"captions", "caption_labels", "caption_embeddings", "text_latents", "mds_shards", "skip_lists",
                     "explorer"}


def code_versions(root: Path, catalog: Path, config: dict | None = None) -> dict[str, str]:
    resources = build_resources(make_settings(root, catalog, config))
    return {key.to_user_string(): version for asset in build_assets(resources)
            for key, version in asset.code_versions_by_key.items()}


def test_samples_metadata_counts_cleaned_and_truncated_captions(ray_session, tmp_path: Path) -> None:
    catalog = image_folder_source(tmp_path / "src", "hostile", count=3)
    captions = tmp_path / "src" / "images" / "part_0"
    (captions / "photo_0.txt").write_text("A dog\x00 on\x1b[2J a\x07 sofa\x85in the sun")
    (captions / "photo_1.txt").write_text("many words " * 100)
    root = tmp_path / "corpus"
    resources = build_resources(make_settings(root, catalog, {"captioner": {"max_caption_chars": 100}}))
    result = materialize(resources, ["raw_source", "samples"], "hostile", fresh_instance(load_catalog(catalog)))
    assert result.success
    meta = materialized(result)["samples"]
    assert (meta["rows"], meta["captions_cleaned"], meta["captions_truncated"]) == (3, 1, 1)
    stored = sorted(read(root, "samples", ["original_caption"])["original_caption"].to_pylist())
    assert stored == sorted(["A dog on[2J a sofa\nin the sun", clean_caption("many words " * 100, 100).text,
                             "Random noise picture number 2"])
    assert max(map(len, stored)) <= 100 and stored[-1].endswith("words")


def test_the_caption_cap_marks_samples_and_the_caption_dependent_assets(tmp_path: Path) -> None:
    catalog = image_folder_source(tmp_path / "src", "any", count=1)
    base = code_versions(tmp_path / "root", catalog)
    capped = code_versions(tmp_path / "root", catalog, {"captioner": {"max_caption_chars": 500}})
    assert {k for k in base if base[k] != capped[k]} == {"samples"} | CAPTION_DEPENDENT
