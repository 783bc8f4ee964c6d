"""Typed stage settings (prx_core.stages.settings) and the manifest they make: its digest names a
committed run (reuse) and an attempt (resume), so it must not move when nothing the settings say
moves. The digests below were computed by the string-keyed settings (before each stage declared a
settings dataclass): equal digests mean every corpus built before keeps its runs and attempts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from prx_core.compute.units import Manifest
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.embeddings import EmbedderConfig
from prx_core.models.label_base import LabelerConfig
from prx_core.sources.catalog import SourceSpec
from prx_core.stages import settings as typed
from prx_core.stages.buckets import BUCKETS, BucketsSettings
from prx_core.stages.entry import STAGES
from prx_core.stages.samples.settings import SamplesSettings
from prx_core.stages.samples.stage import SAMPLES
from prx_core.stages.skip_lists.stage import SkipPolicy
from prx_core.stages.source_embeddings import SOURCE_EMBEDDINGS
from prx_core.stages.stage import Stage, UnitSize, bind_settings

UNPINNED = "never in the manifest"  # an unpinned config: any value gives the same digest
SPEC = SourceSpec("photos", "folder", "/data/photos", caption_column="caption", metadata_columns=("license",))
CAPTIONER, LABELER, EMBEDDER = CaptionerConfig(backend="source"), LabelerConfig(), EmbedderConfig()
LATENTS = {"preset": "p", "encoder_version": "e", "masks": True, "max_tokens": 8}
VERSIONS = {"captioner_version": "cap-1", "labeler_version": "lab-1"}

# stage -> [(given settings, the digest the string-keyed settings gave)]: the defaults, then others
CASES: dict[str, list[tuple[dict[str, Any], str]]] = {
    "samples": [
        ({"spec": SPEC}, "80d1cecfe3f2e8cf"),
        ({"spec": SPEC, "max_pixels": 1 << 20, "unit_bytes": 1 << 20, "unit_rows": 5, "unit_seconds": 9.0,
          "allow_empty": True, "max_caption_chars": 100}, "63f4e2d433e9363c")],
    "buckets": [({}, "17d9aedd1b000c16"), ({"max_tier": 1024, "unit_rows": 7}, "ac234e7672fedf54")],
    "phashes": [({}, "12e8f49baf028d8b"), ({"max_pixels": 1 << 20, "unit_rows": 7}, "6c60e0c5bfc4c8b0")],
    "mds_shards": [
        ({"captioner_version": "cap-1"}, "1617c1a2566a7190"),
        ({"captioner_version": "cap-1", "max_tier": 512, "route_rows": 3, "chunk_rows": 5, "min_stream_samples": 2,
          "merge_small": True, "latents": LATENTS}, "57c005416227d748")],
    "skip_lists": [
        ({**VERSIONS, "policy": SkipPolicy()}, "984633d494c26165"),
        ({**VERSIONS, "policy": SkipPolicy(duplicates=False, labels=("nsfw",), opt_out=("a",), unlabelled=False)},
         "96dde8ccce936b5b")],
    "duplicates": [
        ({}, "d39e5aa3817c13f2"),
        ({"unit_rows": 7, "rows_per_bucket": 9, "full": True, "rule": "phash", "sample_rows": 3}, "4b8743072bbf9b31")],
    "captions": [({"config": CAPTIONER}, "fdd755443e1b4104"),
                 ({"config": CAPTIONER, "unit_rows": 3, "actors": 2}, "71b8ce3c99f054bc")],
    "caption_labels": [({"captioner_version": "cap-1", "config": LABELER}, "fb483145880aac0b"),
                       ({"captioner_version": "cap-1", "config": LABELER, "unit_rows": 3, "actors": 2},
                        "b49af9b10f06ed61")],
    "caption_embeddings": [({"captioner_version": "cap-1", "config": EMBEDDER}, "00f0c0ce28f200ab"),
                           ({"captioner_version": "cap-1", "config": EMBEDDER, "unit_rows": 3}, "4f3869efdbf6f3af")],
    "text_latents": [({"captioner_version": "cap-1", "config": UNPINNED}, "48f79d9dcf47a87a"),
                     ({"captioner_version": "cap-1", "config": UNPINNED, "unit_rows": 3, "gpus": 1.0},
                      "b071b898bdf473d9")],
    "explorer": [(VERSIONS, "efa91f6c5f6e87cc"), ({**VERSIONS, "unit_rows": 3}, "84c8e23721214746")],
    "source_embeddings": [({"samples_version": 4}, "113510a0e49758a3"),
                          ({"samples_version": 4, "unit_rows": 3}, "7885fc597748aec2")],
}
DECLARED: dict[str, Stage] = {**STAGES, SOURCE_EMBEDDINGS.name: SOURCE_EMBEDDINGS}


def params_of(stage: Stage, given: dict[str, Any]) -> dict[str, Any]:
    """The manifest params `run_partition` starts from (before `pin` adds what it computes)."""
    return typed.pinned(bind_settings(stage, given), stage.unpinned)


def test_every_declared_stage_has_cases() -> None:
    assert set(CASES) == set(DECLARED)


@pytest.mark.parametrize(("name", "case"), [(n, i) for n, cases in CASES.items() for i in range(len(cases))])
def test_the_manifest_digest_of_each_stage_is_the_one_string_keyed_settings_gave(name: str, case: int) -> None:
    stage, (given, digest) = DECLARED[name], CASES[name][case]
    manifest = Manifest(stage.name, "photos", {"samples": 3}, stage.code_version, params_of(stage, given))
    assert manifest.digest() == digest


def test_the_params_are_the_flat_dict_the_string_keyed_settings_made() -> None:
    """Field name -> the value itself: a nested dataclass (the spec) is not turned into a dict
    (`asdict` would), and the unpinned settings are left out."""
    params = params_of(SAMPLES, {"spec": SPEC, "unit_bytes": 5})
    assert params["spec"] is SPEC and params["unit_bytes"] == 5
    assert set(params) == {"spec", "max_pixels", "unit_bytes", "max_caption_chars"}


def test_bound_settings_are_the_stage_dataclass() -> None:
    bound = bind_settings(BUCKETS, {"unit_rows": 7})
    assert isinstance(bound, BucketsSettings) and bound.unit_rows == 7 and bound.max_tier == 4096
    with pytest.raises(TypeError, match="unknown setting.*unit_row, x\\b.*settings: max_tier, unit_rows"):
        bind_settings(BUCKETS, {"unit_row": 7, "x": 1})
    with pytest.raises(TypeError, match="missing setting.*spec"):
        bind_settings(SAMPLES, {})


def test_a_worker_rebuilds_the_settings_from_the_manifest_params() -> None:
    """The pinned fields as pinned, the unpinned at their defaults (they never enter the manifest)."""
    params = params_of(BUCKETS, {"max_tier": 1024})
    assert BucketsSettings.from_params(params) == BucketsSettings(max_tier=1024)
    pinned = {**params_of(SAMPLES, {"spec": SPEC, "max_pixels": 9}), "spec": SPEC.to_dict(), "joins": ()}
    assert SamplesSettings.from_params(pinned) == SamplesSettings(spec=SPEC, max_pixels=9)


def test_a_declaration_naming_no_field_fails_at_import() -> None:
    with pytest.raises(TypeError, match="buckets: unit_row named but not a field of BucketsSettings"):
        replace(BUCKETS, unit_sizes=(UnitSize("unit_row", "a typo"),))
    with pytest.raises(TypeError, match="buckets: max_pixels named but not a field"):
        replace(BUCKETS, unpinned=("max_pixels",))
    with pytest.raises(TypeError, match="settings must be a Settings dataclass"):
        replace(BUCKETS, settings={"unit_rows": 7})
    with pytest.raises(TypeError, match="non-frozen"):  # a setting cannot change under a running stage

        @dataclass(kw_only=True)
        class Mutable(BucketsSettings):
            pass
