"""The demo corpus the asset tests read: its planted samples keyed like the pipeline (`Manifest`),
the corpus built once (`Corpus`) and what reads it (tables, streams, caption keys), and small
sources of their own."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa

from prx_cli.build import BuildOutcome
from prx_core.demo import Planted
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import caption_keys
from prx_core.sources.catalog import Catalog
from prx_core.store import lance_io
from prx_core.store.schemas import sample_id
from prx_core.store.storage import Storage


SOURCES = ("stock_photos", "web_images", "crawl_wds", "hf_photos")

SAMPLES_REASONS = {"truncated", "empty", "not_an_image", "too_many_pixels", "format_not_allowed"}

BUCKETS_REASONS = {"below_floor", "aspect_ratio"}


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


def copy_corpus(corpus: Corpus, dest: Path) -> Path:
    """A private copy of the built corpus (Lance tables, MDS, skip-lists) for tests that write."""
    shutil.copytree(corpus.root, dest, symlinks=True)
    return dest


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
