"""Which corpus the definitions build, from the environment (and an optional YAML file).

`PRX_ROOT` (corpus root, local or s3://), `PRX_SOURCES` (the catalog) and `PRX_CONFIG` (a YAML
file with resource fields: storage, captioner, labeler, embedder, text_latents, skip_policy, explorer, ray, units, training, checks;
and `automation`: the schedules' cron strings and what the scheduled refresh materializes) are
read once when the code location loads, because the captioner, labeler, embedder and policy
settings become the `code_version`s of their assets. The defaults are the demo that `make demo` builds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prx_core.sources.catalog import CatalogError
from prx_core.store.credentials import SecretInConfigError, refuse_literal_secrets

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / ".prx" / "demo" / "corpus"
DEFAULT_SOURCES = REPO / ".prx" / "demo" / "sources" / "sources.yaml"
SECTIONS = ("storage", "captioner", "labeler", "embedder", "text_latents", "skip_policy", "explorer", "ray", "units",
            "training", "checks", "automation")
PER_SOURCE = ["raw_source", "samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings",
              "text_latents", "mds_shards"]
ALL_ASSETS = [*PER_SOURCE, "duplicates", "skip_lists", "explorer"]
UNSTORED = ["corpus_plan"]  # assets beside the corpus: they write nothing under the root
# A per-source backfill runs in two runs (prx_assets.backfill): the CPU stages, then the chain whose
# root is `captions` (pool gpu), so a run waiting for the GPU waits in the queue, never in a run slot.
CPU_STAGES = PER_SOURCE[:4]
GPU_CHAIN = PER_SOURCE[4:]
THEN_TAG = "prx/then"  # on a CPU run: the GPU-chain assets to queue for its partition once it succeeded


class SettingsError(CatalogError):
    """A request or settings file that cannot run; the message names what to fix."""


def validate_request(catalog_names: list[str], sources: list[str] | None, select: list[str] | None) -> None:
    """Checked before dagster and Ray load, so a typo costs a second, not twenty."""
    unknown = sorted(set(select or []) - set(ALL_ASSETS))
    if unknown:
        raise SettingsError(f"unknown assets {', '.join(unknown)}; choose from {', '.join(ALL_ASSETS)}")
    missing = sorted(set(sources or []) - set(catalog_names))
    if missing:
        raise SettingsError(f"sources {', '.join(missing)} are not in the catalog ({', '.join(catalog_names)})")


@dataclass(frozen=True)
class Settings:
    root: str
    sources: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.config.get(name) or {})

    def ray_start(self) -> dict[str, Any]:
        """`start_ray` keywords of a CLI command that starts Ray before any resource does (the
        resources then reuse it): the cluster's `address`, else the embedded Ray's `ray_init_options`."""
        ray = self.section("ray")
        return {"address": ray["address"]} if ray.get("address") else dict(ray.get("ray_init_options") or {})


def load_settings(environ: dict[str, str] | None = None, required: bool = False) -> Settings:
    """The settings the environment names; with `required` (Dagster's own tools loading the code
    location), a missing PRX_ROOT or PRX_SOURCES is an error naming it, never the demo's by default:
    a fresh shell's `dagster asset materialize` would otherwise build some other corpus."""
    env = os.environ if environ is None else environ
    missing = [name for name in ("PRX_ROOT", "PRX_SOURCES") if required and not env.get(name)]
    if missing:
        raise SettingsError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: Dagster's CLI "
                            "and UI load prx_assets.definitions from the environment; export PRX_ROOT (the corpus "
                            "root), PRX_SOURCES (the catalog), PRX_CONFIG (settings, if any) and DAGSTER_HOME, as "
                            "`prx-corpus sources sync` prints them")
    config: dict[str, dict[str, Any]] = {}
    if path := env.get("PRX_CONFIG"):
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise SettingsError(f"{path}: cannot read settings: {exc.strerror or exc}") from exc
        except yaml.YAMLError as exc:
            raise SettingsError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(config, dict):
            raise SettingsError(f"{path}: expected a mapping of sections {list(SECTIONS)}")
        unknown = sorted(set(config) - set(SECTIONS))
        if unknown:
            raise SettingsError(f"{path}: unknown sections {unknown}; expected some of {list(SECTIONS)}")
        try:  # the config is stored with every run and sent to Ray tasks: never a secret in it
            refuse_literal_secrets(config, path)
        except SecretInConfigError as exc:
            raise SettingsError(str(exc)) from None
    return Settings(root=env.get("PRX_ROOT", str(DEFAULT_ROOT)), sources=env.get("PRX_SOURCES", str(DEFAULT_SOURCES)),
                    config=config)
