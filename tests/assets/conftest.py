"""Shared state of the asset tests: one local Ray, one corpus built once from the demo sources.

The whole graph is materialized ONCE per session (`corpus`) through `prx_cli.build.run_build`
on an ephemeral Dagster instance, with the real local resources of `build_resources` (Lance on
disk under a temporary root, the embedded Ray reusing the session's Ray). Most tests only read
what it produced; the few that materialize again work on a copy of the corpus (`copy_corpus`)
so they never change what the others read.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from prx_cli.build import QUIET_LOGS, BuildOutcome, run_build
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_assets, build_definitions, build_resources
from prx_assets.settings import Settings
from prx_core.demo import Planted, load_manifest
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import caption_keys
from prx_core.sources.catalog import Catalog, load_catalog
from prx_core.store import lance_io
from prx_core.store.schemas import sample_id
from prx_core.store.storage import Storage

SOURCES = ("stock_photos", "web_images", "crawl_wds", "hf_photos")
# reject reasons the `samples` stage gives (the others are given by `buckets`)
SAMPLES_REASONS = {"truncated", "empty", "not_an_image", "too_many_pixels", "format_not_allowed"}
BUCKETS_REASONS = {"below_floor", "aspect_ratio"}


# -- Ray ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray for every test of tests/assets; `EmbeddedRay` reuses it in every run."""
    import ray

    from prx_core.compute.quiet import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=2)  # as `prx-corpus build` starts it: on loopback only
    yield ray
    ray.shutdown()


# -- the demo manifest, keyed like the pipeline --------------------------------------------------------

@dataclass(frozen=True)
class PlantedSample:
    """A manifest entry with the pipeline's `source_key` and `sample_id`."""

    planted: Planted
    source_key: str

    @property
    def source(self) -> str:
        return self.planted.source

    @property
    def sample_id(self) -> str:
        return sample_id(self.planted.source, self.source_key)

    @property
    def reject(self) -> str | None:
        return self.planted.reject

    @property
    def kinds(self) -> list[str]:
        return self.planted.kinds


@dataclass(frozen=True)
class Manifest:
    samples: tuple[PlantedSample, ...]

    def of(self, source: str) -> list[PlantedSample]:
        return [s for s in self.samples if s.source == source]

    def with_kind(self, kind: str) -> list[PlantedSample]:
        return [s for s in self.samples if kind in s.kinds]

    def groups(self) -> dict[str, dict[str, PlantedSample]]:
        """duplicate group -> role -> sample."""
        out: dict[str, dict[str, PlantedSample]] = {}
        for s in self.samples:
            if s.planted.group:
                out.setdefault(s.planted.group, {})[s.planted.role] = s
        return out


def source_keys(catalog: Catalog) -> dict[tuple[str, str], str]:
    """(source, manifest key) -> the reader's source_key. Image folders key by the path relative
    to the source root without extension (`batch_00/img_00010`), the others by the manifest key."""
    out: dict[tuple[str, str], str] = {}
    for spec in catalog.sources:
        if spec.format != "imagefolder":
            continue
        root = Path(spec.uri)
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix != ".txt":
                out[(spec.name, path.stem)] = path.relative_to(root).with_suffix("").as_posix()
    return out


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


# -- materializing ------------------------------------------------------------------------------------

def make_settings(root: Path | str, sources: Path | str, config: dict | None = None) -> Settings:
    return Settings(root=str(root), sources=str(sources), config=config or {})


def fresh_instance(catalog: Catalog) -> dg.DagsterInstance:
    instance = dg.DagsterInstance.ephemeral()
    sync_partitions(instance, catalog)
    return instance


def materialize(resources: dict, selection: list[str], partition: str | None,
                instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """One run of `selection` with the assets built from `resources` (as the definitions do)."""
    return dg.materialize(build_assets(resources), selection=selection, partition_key=partition, instance=instance,
                          resources=resources, run_config=QUIET_LOGS, raise_on_error=False)


def checks_of(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def materialized(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, Any]]:
    """asset -> metadata values of its materialization in this run."""
    return {e.materialization.asset_key.to_user_string(): {k: v.value for k, v in e.materialization.metadata.items()}
            for e in result.get_asset_materialization_events()}


def resources_for(corpus: "Corpus", root: Path, config: dict | None = None) -> dict[str, Any]:
    """The resources `build_resources` gives for another root (a copy) and/or another config."""
    return build_resources(make_settings(root, corpus.sources, config))


def check(result: dg.ExecuteInProcessResult, name: str) -> dg.AssetCheckEvaluation:
    return checks_of(result)[name]


INDEX_OPERATIONS = {"CreateIndex"}  # FTS / vector index refreshes: new versions, same rows


def commits_since(root: Path | str, table: str, version: int) -> list[tuple[int, str]]:
    """(version, Lance operation) of every commit after `version`, oldest first."""
    ds = lance_io.require_table(Storage(str(root)).lance_uri(table))
    count = ds.version - version
    transactions = ds.get_transactions(count) if count > 0 else []
    return sorted((ds.version - i, type(tx.operation).__name__) for i, tx in enumerate(transactions))


def data_version(result: dg.ExecuteInProcessResult, asset: str) -> str | None:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return event.materialization.tags.get("dagster/data_version")

def read(root: Path | str, table: str, columns: list[str] | None = None, filter: str | None = None,
         version: int | None = None) -> pa.Table:
    return lance_io.read_table(Storage(str(root)).lance_uri(table), columns, filter, version=version)


def version_of(root: Path | str, table: str) -> int | None:
    return lance_io.table_version(Storage(str(root)).lance_uri(table))


def tree_digest(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `folder`."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def stream_dirs(root: Path | str, source: str) -> list[Path]:
    """Published streams of a source, as a trainer lists them: `<root>/mds/<source>/<tier>/*`
    holding index.json."""
    return sorted(d for d in Path(root, "mds", source).glob("*/*") if (d / "index.json").is_file())


# -- the corpus built once ------------------------------------------------------------------------------

@dataclass
class Corpus:
    root: Path
    sources: Path
    catalog: Catalog
    instance: dg.DagsterInstance
    resources: dict[str, Any]
    outcome: BuildOutcome
    seconds: float
    log: list[str] = field(default_factory=list)
    checks: dict[tuple[str, str | None], Any] = field(default_factory=dict)  # (check, partition) -> evaluation

    def metadata(self, asset: str, partition: str | None) -> dict[str, Any]:
        return self.outcome.metadata[(asset, partition)]

    def table(self, name: str, columns: list[str] | None = None, filter: str | None = None) -> pa.Table:
        return read(self.root, name, columns, filter)

    def rows(self, name: str, columns: list[str] | None = None, filter: str | None = None) -> list[dict]:
        return self.table(name, columns, filter).to_pylist()

    def caption_keys(self, source: str | None = None) -> dict[str, str]:
        return caption_keys_by_sample(self.root, source)

    def labels(self, source: str | None = None) -> dict[str, str | None]:
        """sample_id -> its caption's label (None: unlabelled)."""
        labels = {r["content_id"]: r["label"] for r in self.rows("caption_labels")}
        return {sid: labels.get(key) for sid, key in self.caption_keys(source).items()}


SOURCE_CAPTIONER = CaptionerConfig("source").version()


def caption_keys_by_sample(root: Path | str, source: str | None = None,
                           captioner_version: str = SOURCE_CAPTIONER) -> dict[str, str]:
    """sample_id -> the key its caption, label and embedding rows carry in `content_id`: the image's
    content for a model caption, (content, source caption) for the source captioner's
    (prx_core.models.caption_keys)."""
    rows = read(root, "samples", ["sample_id", "content_id", "original_caption"],
                f"source = '{source}'" if source else None).to_pylist()
    keys = caption_keys(captioner_version, [r["content_id"] for r in rows], [r["original_caption"] for r in rows])
    return {r["sample_id"]: key for r, key in zip(rows, keys)}


def collect_checks(instance: dg.DagsterInstance) -> dict[tuple[str, str | None], Any]:
    """Every asset check evaluation of every run, by (check name, partition)."""
    out: dict[tuple[str, str | None], Any] = {}
    for run in instance.get_runs():
        partition = run.tags.get("dagster/partition")
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            evaluation = entry.dagster_event.event_specific_data
            out[(evaluation.check_name, partition)] = evaluation
    return out


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


def copy_corpus(corpus: Corpus, dest: Path) -> Path:
    """A private copy of the built corpus (Lance tables, MDS, skip-lists) for tests that write."""
    shutil.copytree(corpus.root, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prx_core.models.tiny_vlm import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


def transformers_config(model: Path) -> dict[str, Any]:
    return {"backend": "transformers", "model": str(model), "max_new_tokens": 8, "max_pixels": 12544, "batch_size": 8}


def by(rows: Iterable[dict], key: str) -> dict[Any, dict]:
    return {r[key]: r for r in rows}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_folder_source(folder: Path, name: str, count: int = 3, captions: bool = True) -> Path:
    """A small image folder source (640x480 noise JPEGs, `.txt` sidecars when `captions`) and
    its one-source catalog; returns the catalog path."""
    import numpy as np
    import yaml
    from PIL import Image

    rng = np.random.default_rng(7)
    images = folder / "images" / "part_0"
    images.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(images / f"photo_{i}.jpg", quality=90)
        if captions:
            (images / f"photo_{i}.txt").write_text(f"Random noise picture number {i}")
    catalog = folder / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{"name": name, "format": "imagefolder", "uri": "images"}]}))
    return catalog



def force_rerun(root: Path | str, asset: str, source: str) -> None:
    """Make a reusable stage (`samples`, `skip_lists`) really run again on unchanged inputs, the
    way docs/operations.md says: remove the record of its last commit."""
    (Path(root) / "_reports" / asset / source / "latest.json").unlink()
