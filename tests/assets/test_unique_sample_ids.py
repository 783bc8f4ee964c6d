"""`samples_unique_sample_ids` blocks on a rate, never on one repeated key: a key column that
repeats between two parquet files (readers only see repeats inside one file) moves the extra row
to `rejects` (duplicate_key) and the source goes on; a key column that repeats everywhere (a
wrong key) blocks and changes nothing."""

from __future__ import annotations

import io
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from demo_corpus import read
from materializing import checks_of, fresh_instance, materialize, materialized
from PIL import Image

from prx_assets.definitions import build_resources
from prx_assets.settings import Settings
from prx_core.sources.catalog import load_catalog

SELECTION = ["raw_source", "samples", "buckets"]


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (400, 400, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def keyed_source(folder: Path, files: dict[str, list[str]]) -> Path:
    """A parquet source of one file per entry, rows keyed by the `key` column; returns its catalog."""
    data = folder / "data"
    data.mkdir(parents=True)
    seed = 0
    for name, keys in files.items():
        images = []
        for _ in keys:
            images.append(jpeg(seed))
            seed += 1
        pq.write_table(pa.table({"key": keys, "image": images, "caption": [f"a picture {k}" for k in keys]}),
                       data / f"{name}.parquet")
    catalog = folder / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{"name": "keyed", "format": "parquet", "uri": "data",
                                                    "image_column": "image", "caption_column": "caption",
                                                    "key_column": "key"}]}))
    return catalog


def run(tmp_path: Path, files: dict[str, list[str]]) -> tuple[dg.ExecuteInProcessResult, Path]:
    catalog = keyed_source(tmp_path / "src", files)
    root = tmp_path / "corpus"
    resources = build_resources(Settings(root=str(root), sources=str(catalog),
                                         config={"checks": {"samples_unique_sample_ids": 0.1}}))
    return materialize(resources, SELECTION, "keyed", fresh_instance(load_catalog(catalog))), root


def meta(evaluation: dg.AssetCheckEvaluation) -> dict:
    return {k: v.value for k, v in evaluation.metadata.items()}


def test_a_key_repeated_across_files_is_one_reject_not_a_halted_source(ray_session, tmp_path: Path) -> None:
    result, root = run(tmp_path, {"a": [f"k{i}" for i in range(10)], "b": ["k9", *(f"m{i}" for i in range(9))]})

    assert result.success
    check = checks_of(result)["samples_unique_sample_ids"]
    assert check.passed
    got = meta(check)
    assert (got["checked"], got["failed"], got["moved_to_rejects"]) == (20, 1, 1)
    assert got["offender_ids"] == ["keyed/k9"] and "duplicate_key" in got["offenders"]
    samples = read(root, "samples", ["sample_id", "content_id"]).to_pylist()
    assert len(samples) == 19 and len({r["sample_id"] for r in samples}) == 19
    (reject,) = read(root, "rejects", filter="reason = 'duplicate_key'").to_pylist()
    kept = next(r for r in samples if r["sample_id"] == "keyed/k9")
    assert reject["sample_id"] == "keyed/k9" and reject["content_id"] > kept["content_id"]  # the smallest is kept
    done = materialized(result)
    assert done["samples"]["rows"] == 19 and done["samples"]["rejects"] == 1
    assert done["buckets"]["rows"] == 19  # downstream reads the resolved table


def test_a_key_column_that_repeats_everywhere_blocks(ray_session, tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(10)]
    result, root = run(tmp_path, {"a": keys, "b": keys})

    check = checks_of(result)["samples_unique_sample_ids"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    got = meta(check)
    assert (got["checked"], got["failed"], got["moved_to_rejects"]) == (20, 10, 0)
    assert got["offender_ids"] == [f"keyed/k{i}" for i in range(10)]
    assert read(root, "samples", ["sample_id"]).num_rows == 20  # nothing changed
    assert "buckets" not in materialized(result) and not result.success
