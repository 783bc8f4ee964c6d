"""Shared state of the asset tests: one local Ray, one corpus built once from the demo sources.

The whole graph is materialized ONCE per session (`corpus`) through `prx_cli.build.run_build`
on an ephemeral Dagster instance, with the real local resources of `build_resources` (Lance on
disk under a temporary root, the embedded Ray reusing the session's Ray). Most tests only read
what it produced; the few that materialize again work on a copy of the corpus (`copy_corpus`)
so they never change what the others read.

The helpers the tests import live in named modules: `materializing` (settings, instances, one run
of a selection, what it reported) and `demo_corpus` (the planted samples, the built corpus and
its readers); this file holds only fixtures."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import pytest
from demo_corpus import Corpus, Manifest, PlantedSample, source_keys
from materializing import collect_checks, make_settings

from prx_cli.build import run_build
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_definitions
from prx_core.demo import load_manifest
from prx_core.sources.catalog import load_catalog


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray for every test of tests/assets; `EmbeddedRay` reuses it in every run."""
    import ray

    from prx_core.compute.quiet import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=2)  # as `prx-corpus build` starts it: on loopback only
    yield ray
    ray.shutdown()



@pytest.fixture(scope="session")
def manifest(demo_dir: Path) -> Manifest:
    keys = source_keys(load_catalog(demo_dir / "sources.yaml"))
    planted = load_manifest(demo_dir).samples
    return Manifest(tuple(PlantedSample(p, keys.get((p.source, p.key), p.key)) for p in planted))



@pytest.fixture(scope="session")
def source_bytes(demo_files: dict, manifest: Manifest) -> dict[str, tuple[bytes, str]]:
    """sample_id -> (source bytes, source caption), read without the pipeline's readers."""
    by_key = {(s.source, s.planted.key): s.sample_id for s in manifest.samples}
    return {by_key[key]: value for key, value in demo_files.items()}



@pytest.fixture(scope="session")
def corpus(ray_session, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """The full graph for the demo sources, in `run_build`'s order: every source's chain
    raw_source..mds_shards, then `duplicates`, then every source's `skip_lists`."""
    root = tmp_path_factory.mktemp("corpus") / "root"
    sources = demo_dir / "sources.yaml"
    settings = make_settings(root, sources)
    defs = build_definitions(settings)
    catalog = load_catalog(sources)
    instance = dg.DagsterInstance.ephemeral()
    sync_partitions(instance, catalog)
    log: list[str] = []
    started = time.monotonic()
    outcome = run_build(defs, instance, catalog.names, None, None, echo=lambda *a, **k: log.append(" ".join(map(str, a))))
    seconds = time.monotonic() - started
    corpus = Corpus(root, sources, catalog, instance, dict(defs.resources), outcome, seconds, log,
                    collect_checks(instance))
    assert outcome.ok, (outcome.failed_runs, outcome.failed_blocking, log)
    return corpus



@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")

