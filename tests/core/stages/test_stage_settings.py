"""The manifest a stage's settings make: its digest names a committed run (reuse) and an attempt
(resume), so it must not move when nothing the settings say moves. The digests below were computed
by the string-keyed settings (before each stage declared a settings dataclass): equal digests mean
every corpus built before keeps its runs and attempts."""

from __future__ import annotations

from typing import Any

import pytest

from prx_core.compute.units import Manifest
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.embeddings import EmbedderConfig
from prx_core.models.label_base import LabelerConfig
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.entry import STAGES
from prx_core.stages.skip_lists import SkipPolicy
from prx_core.stages.source_embeddings import SOURCE_EMBEDDINGS
from prx_core.stages.stage import Stage, bind_settings

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
    return {k: v for k, v in bind_settings(stage, given).items() if k not in stage.unpinned}


def test_every_declared_stage_has_cases() -> None:
    assert set(CASES) == set(DECLARED)


@pytest.mark.parametrize(("name", "case"), [(n, i) for n, cases in CASES.items() for i in range(len(cases))])
def test_the_manifest_digest_of_each_stage_is_the_one_string_keyed_settings_gave(name: str, case: int) -> None:
    stage, (given, digest) = DECLARED[name], CASES[name][case]
    manifest = Manifest(stage.name, "photos", {"samples": 3}, stage.code_version, params_of(stage, given))
    assert manifest.digest() == digest
