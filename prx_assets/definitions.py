"""Dagster definitions of the corpus (loaded by workspace.yaml, the CLI and the tests).

raw_source -> samples -> buckets -> captions -> caption_labels -> skip_lists
                      -> phashes -> duplicates (global) ------------^
                         buckets + captions -> mds_shards ----------^
              samples + captions -> caption_embeddings (for the explorer; nothing depends on it)
              samples + captions -> text_latents (optional, off unless configured) -> mds_shards
              every per-source table + skip_lists -> explorer (what `prx-corpus browse` reads)
"""

from __future__ import annotations

import os
import sys

import dagster as dg

from prx_assets import automation, backfill
from prx_assets.buckets import buckets_asset
from prx_assets.caption_embeddings import caption_embeddings_asset
from prx_assets.caption_labels import caption_labels_asset
from prx_assets.captions import captions_asset
from prx_assets.common import with_conventions
from prx_assets.corpus_plan import corpus_plan
from prx_assets.duplicates import duplicates
from prx_assets.explorer import explorer_asset
from prx_assets.mds_shards import mds_shards_asset
from prx_assets.phashes import phashes
from prx_assets.raw_source import raw_source
from prx_assets.samples import samples_asset
from prx_assets.settings import Settings, SettingsError, load_settings
from prx_assets.skip_lists import skip_lists_asset
from prx_assets.text_latents import text_latents_asset
from prx_resources import (
    CaptionerResource,
    CatalogResource,
    ChecksResource,
    EmbeddedRay,
    EmbedderResource,
    ExplorerResource,
    LabelerResource,
    RayCluster,
    SkipPolicyResource,
    StorageResource,
    TextLatentsResource,
    TrainingResource,
    UnitsResource,
)
from prx_resources.ray import never_cleanup


def build_resources(settings: Settings) -> dict[str, dg.ConfigurableResource]:
    ray_config = settings.section("ray")
    ray = RayCluster(**ray_config) if ray_config.get("address") else EmbeddedRay(**{"lifecycle": never_cleanup(), **ray_config})
    return {
        "storage": StorageResource(**{"root": settings.root, **settings.section("storage")}),
        "catalog": CatalogResource(path=settings.sources),
        "captioner": CaptionerResource(**settings.section("captioner")),
        "labeler": LabelerResource(**settings.section("labeler")),
        "embedder": EmbedderResource(**settings.section("embedder")),
        "text_latents": TextLatentsResource(**settings.section("text_latents")),
        "policy": SkipPolicyResource(**settings.section("skip_policy")),
        "explorer": ExplorerResource(**settings.section("explorer")),
        "units": UnitsResource(**settings.section("units")),
        "training": TrainingResource(**settings.section("training")),
        "checks": ChecksResource(**settings.section("checks")),
        "ray": ray,
    }


def build_assets(resources: dict[str, dg.ConfigurableResource]) -> list[dg.AssetsDefinition]:
    storage, captioner, labeler, embedder, policy = (
        resources[k] for k in ("storage", "captioner", "labeler", "embedder", "policy"))
    return with_conventions([
        raw_source, samples_asset(storage, captioner), buckets_asset(storage), phashes, duplicates,
        captions_asset(captioner, resources["text_latents"]), caption_labels_asset(captioner, labeler),
        caption_embeddings_asset(captioner, embedder),
        text_latents_asset(captioner, resources["text_latents"]),
        mds_shards_asset(storage, captioner, resources["training"], resources["text_latents"]),
        skip_lists_asset(captioner, labeler, policy), explorer_asset(captioner, labeler), corpus_plan,
    ], resources)  # owners, and kinds true for the configured root and the catalog's formats


def build_definitions(settings: Settings) -> dg.Definitions:
    resources = build_resources(settings)
    return dg.Definitions(
        assets=build_assets(resources),
        jobs=[automation.build_source_job, automation.refresh_source_job, automation.dedup_corpus_job,
              automation.publish_source_job,
              automation.compact_corpus, backfill.ingest_source_job, backfill.caption_source_job],
        schedules=[automation.weekly_source_refresh, automation.compact_schedule],
        sensors=[automation.sources_sensor, automation.automation_condition_sensor, backfill.caption_after_ingest],
        resources=resources,
    )


@dg.definitions
def defs() -> dg.Definitions:
    """What Dagster's tools load (`-m prx_assets.definitions`, workspace.yaml, the code server): the
    corpus PRX_ROOT, PRX_SOURCES and PRX_CONFIG name, built when loaded, not when imported."""
    try:
        settings = load_settings(required=True)
    except SettingsError as exc:
        if dagster_command():  # `dagster asset materialize ...` loads here: one line, not Dagster's traceback
            print(f"prx_assets.definitions: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise  # a code server (`dagster api grpc`, under `dagster dev` too): the UI shows it as the location's error
    return build_definitions(settings)


def dagster_command(argv: list[str] | None = None) -> bool:
    """Whether this process is one of Dagster's CLI commands that load the definitions themselves."""
    argv = sys.argv if argv is None else argv
    return os.path.basename(argv[0]) == "dagster" and argv[1:2] not in (["api"], ["dev"], ["code-server"])
