"""`captions` and `caption_labels` as work units on model actors, on a real local Ray and real
Lance tables: the same rows as a single-process reference for any unit size, each caption key once
per model version across sources (under the `source` captioner a key is a content and its own
caption text: prx_core.models.caption_keys), failures replaced rather than duplicated, and a rerun
after a SIGKILL that runs only the units not recorded and appends what they wrote exactly once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pyarrow as pa
import pytest
from corpora import stored_labels
from crash import kill_at, recorded_units

from prx_core.compute.unit_results import read_detail
from prx_core.compute.units import RUNS
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import source_caption_key
from prx_core.models.captioning import SourceCaptioner
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.labels import build_labels
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import source_predicate, write_partition
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
CONFIG = CaptionerConfig("source")
# source a: (key, content, source caption, bucketed); c3 twice under two captions (two keys, k10's
# in another unit when units are small), c5 dropped at k05 but bucketed at k11 (its caption: k11's),
# c7 has no caption (counted, not a failure), c9 only dropped. b: c1 with a's text (a's key, shared),
# c2 with its own (its own key)
A = [("k00", "c0", "a dog"), ("k01", "c1", "a cat"), ("k02", "c2", "an invoice"), ("k03", "c3", "first c3"),
     ("k04", "c4", "  a tree  "), ("k05", "c5", "dropped c5", False), ("k06", "c6", "a boat"), ("k07", "c7", None),
     ("k08", "c8", "a car"), ("k09", "c9", "dropped", False), ("k10", "c3", "second c3"), ("k11", "c5", "kept c5")]
B = [("k0", "c1", "a cat"), ("k1", "c2", "the invoice"), ("k2", "b0", "a lake"), ("k3", "b1", "a road")]


def write_source(storage: Storage, source: str, rows: list[tuple]) -> None:
    samples, buckets = [], []
    for key, content, caption, *bucketed in rows:
        sample_id = f"{source}/{key}"
        samples.append({"sample_id": sample_id, "content_id": content, "source": source, "source_key": key,
                        "image": b"", "width": 512, "height": 512, "num_bytes": 1, "original_caption": caption})
        kept = not bucketed or bucketed[0]
        buckets.append({"sample_id": sample_id, "source": source, "content_id": content, "width": 512, "height": 512,
                        **({"tier": 512, "bucket_width": 512, "bucket_height": 512, "bucket": "512x512"} if kept
                           else {"drop_reason": "too_small"})})
    write_partition(storage, "samples", source_predicate(source), pa.Table.from_pylist(samples, schema=schemas.SAMPLES))
    write_partition(storage, "buckets", source_predicate(source), pa.Table.from_pylist(buckets, schema=schemas.BUCKETS))


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    write_source(storage, "a", A)
    write_source(storage, "b", B)
    return storage


def eligible(rows: list[tuple]) -> dict[str, str | None]:
    """caption key -> source caption, one per (content, caption) pair of a bucketed sample: the
    single-process rule."""
    keys: dict[str, str | None] = {}
    for key, content, caption, *bucketed in sorted(rows):
        if not bucketed or bucketed[0]:
            keys.setdefault(source_caption_key(content, caption), caption)
    return keys


def reference_captions(rows: list[tuple]) -> set[tuple]:
    keys = eligible(rows)
    results = SourceCaptioner(CONFIG).caption_batch([b""] * len(keys), list(keys.values()))
    return {(k, r.caption or "", (r.error or "").split(":")[0]) for k, r in zip(keys, results)}


def caption_rows(storage: Storage, contents: set[str] | None = None) -> list[tuple]:
    table = lance_io.read_table(storage.lance_uri("captions"), filter=f"captioner_version = '{CONFIG.version()}'")
    return sorted((r["content_id"], r["caption"], r["error"].split(":")[0]) for r in table.to_pylist()
                  if contents is None or r["content_id"] in contents)


@pytest.mark.parametrize("unit_rows", [1, 3, 100])
def test_captions_units_give_the_reference_rows_once_per_content(storage: Storage, unit_rows: int) -> None:
    report = build_captions("a", storage, CONFIG, unit_rows=unit_rows)
    want = reference_captions(A)
    assert caption_rows(storage) == sorted(want)  # one row per caption key: no duplicate keys
    assert {"first c3", "second c3", "kept c5"} <= {row[1] for row in caption_rows(storage)}
    assert report.units.units == -(-len(A) // unit_rows) and report.units.ran == report.units.units
    assert (report.eligible, report.reused, report.captioned, report.failed) == (10, 0, 9, 0)
    assert report.without_source_caption == 1 and report.without_source_caption_examples == ["a/k07"]
    assert report.failures == {} and report.missing == 1 and report.captioner_missing == 0
    # one append (64 units per append by default), then, from two units on, their fragments merged into one
    assert report.commits == (1 if report.units.units == 1 else 2) and report.model_seconds > 0
    assert len(lance_io.require_table(storage.lance_uri("captions")).get_fragments()) == 1
    assert not os.listdir(os.path.join(storage.root, RUNS, "captions", "a"))  # the attempt is forgotten

    same = build_captions("a", storage, CONFIG, unit_rows=unit_rows)  # nothing failed: the run is reused
    assert (same.units.ran, same.units.skipped, same.captioned) == (0, report.units.units, 9)
    assert force_next_run(storage, "captions", "a")  # forced: every caption found stored
    again = build_captions("a", storage, CONFIG, unit_rows=unit_rows)
    assert (again.reused, again.captioned, again.failed, again.without_source_caption) == (9, 0, 0, 1)
    assert caption_rows(storage) == sorted(want)

    other = build_captions("b", storage, CONFIG, unit_rows=unit_rows)  # c1, c2 are a's bytes; c1 a's text too
    assert (other.eligible, other.reused, other.captioned) == (4, 1, 3)
    assert caption_rows(storage) == sorted(want | reference_captions(B))  # b's c2 has its own caption
    assert len(caption_rows(storage)) == len(want) + 3


def test_a_small_source_in_a_bigger_table_runs_in_smaller_units_with_the_same_captions(storage: Storage) -> None:
    """A range of a source's content ids holds the other sources' keys between its own, which the
    unit's range reads and lookups cross: where its units would span more than RANGE_TABLE_ROWS
    rows of the table they get fewer rows (prx_core.compute.key_ranges.range_unit_rows), with ids
    that say so. With a budget of 2 rows, a's 12 of the 16 rows run in units of 2 and b's 4 in
    units of 1, and the captions are the single-process reference's."""
    with patch("prx_core.compute.key_ranges.RANGE_TABLE_ROWS", 2):
        first = build_captions("a", storage, CONFIG, unit_rows=4)
        report = build_captions("b", storage, CONFIG, unit_rows=4)
    assert (first.units.units, report.units.units, report.units.ran) == (6, 4, 4)
    assert [s["unit"] for s in read_detail(storage, report.units.detail_uri)] == [f"k1r{i:07d}" for i in range(4)]
    assert caption_rows(storage) == sorted(reference_captions(A) | reference_captions(B))
    assert (report.eligible, report.reused, report.captioned) == (4, 1, 3)


def test_labels_units_give_the_reference_labels_once_per_content(storage: Storage) -> None:
    build_captions("a", storage, CONFIG)
    build_captions("b", storage, CONFIG)
    config = LabelerConfig()
    first = build_labels("a", storage, CONFIG.version(), config, unit_rows=4)
    assert (first.captioned, first.reused, first.labelled, first.failed) == (9, 0, 9, 0)
    assert sum(first.distribution.values()) == 9 and first.units.units == 3
    captions = dict(row[:2] for row in caption_rows(storage) if not row[2])
    ids = sorted(c for c in eligible(A) if c in captions)
    reference = LabelBatch(config)({"content_id": ids, "caption": [captions[c] for c in ids]})
    stored = {r["content_id"]: r for r in stored_labels(storage, config, CONFIG.version()).to_pylist()}
    assert sorted(stored) == ids
    assert [stored[c]["label"] for c in ids] == list(reference["label"])
    np.testing.assert_allclose([stored[c]["score"] for c in ids], reference["score"], rtol=1e-5)

    second = build_labels("b", storage, CONFIG.version(), config, unit_rows=4)  # c1 with a's text: labelled already
    assert (second.captioned, second.reused, second.labelled) == (4, 1, 3)
    assert len(stored_labels(storage, config, CONFIG.version())) == 12


SCRIPT = """
import ray, sys
from prx_core.models.caption_base import CaptionerConfig
from prx_core.stages.captions.stage import build_captions
from prx_core.upkeep.appends import BatchedAppend
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
storage = Storage(sys.argv[1])
build_captions("a", storage, CaptionerConfig("source"), unit_rows=2, appends=BatchedAppend(storage, "captions", every_units=2))
"""


def test_a_killed_captions_run_reruns_only_its_unrecorded_units_and_appends_once(storage: Storage, ray_cluster) -> None:
    kill_at("captions:units:3", SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address)
    time.sleep(2)  # the dead driver's actor goes with it; a unit it was finishing may still record
    recorded = len(recorded_units(storage.root, "captions", "a"))
    assert recorded >= 3
    (attempt,) = Path(storage.root, RUNS, "captions", "a").iterdir()
    manifest = json.loads((attempt / "run.json").read_text())["manifest"]  # the captioner by its version only:
    reads = manifest["params"].pop("source_reads")  # the source's part of the volatile samples and buckets
    assert manifest["params"] == {"captioner_version": CONFIG.version(), "unit_rows": 2}  # no config, actors, appends
    assert sorted(reads) == sorted(manifest["volatile"]) == ["buckets", "samples"]
    committed = len(caption_rows(storage)) if lance_io.table_exists(storage.lance_uri("captions")) else 0
    assert committed >= 2  # the first append (after 2 units) survived the crash
    write_source(storage, "late", [("k0", "l0", "a hill")])  # another source moves samples and buckets

    report = build_captions("a", storage, CONFIG, unit_rows=2)  # resumed all the same: a's part is unchanged
    assert report.units.skipped == recorded and report.units.ran == report.units.units - recorded == 6 - recorded
    assert caption_rows(storage) == sorted(reference_captions(A))  # recorded rows appended once, none lost
    assert (report.eligible, report.captioned + report.reused, report.without_source_caption) == (10, 9, 1)
