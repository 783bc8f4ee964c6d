"""An image folder of 100k files (issue 24, hazard 8): walked in parallel batches, each folder
reduced where it is listed, so neither the plan nor the observation holds a record per file; the
same answers as a plain `os.walk`, on threads, on Ray workers and on S3 (where s3fs's listing
cache would otherwise keep every listing)."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import boto3
import pytest

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders.walk import list_folders, walk_folders
from prx_core.sources.readers import fragment_sizes, observe_source
from prx_core.store.storage import filesystem_for

FOLDERS, PER_FOLDER = 400, 250  # 100,000 image files, two levels deep


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("walk") / "photos"
    for f in range(FOLDERS):
        folder = root / f"shard-{f // 20:02d}" / f"part-{f:04d}"
        folder.mkdir(parents=True)
        for i in range(PER_FOLDER):
            (folder / f"{i:05d}.jpg").write_bytes(b"x" * (1 + i % 3))
        (folder / "00000.txt").write_text("a caption")
    (root / "metadata.jsonl").write_text("{}\n")
    return root


def reference_fragments(root: Path) -> list[tuple[str, int]]:
    out = []
    for folder, _, files in os.walk(root):
        images = sum(os.path.getsize(os.path.join(folder, f)) for f in files if f.endswith(".jpg"))
        if images:
            out.append((folder, images))
    return sorted(out)


def test_a_100k_file_folder_is_planned_and_observed_without_a_record_per_file(big_folder: Path) -> None:
    spec = SourceSpec("big", "imagefolder", str(big_folder))
    assert fragment_sizes(spec) == reference_fragments(big_folder)

    tracemalloc.start()
    try:
        seen = observe_source(spec)
        _, walked_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        everything = filesystem_for(str(big_folder), None).find(str(big_folder), detail=True)  # the old observation
        _, find_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(everything) == seen["files"] == FOLDERS * (PER_FOLDER + 1) + 1
    assert seen["fragments"] == FOLDERS and seen["bytes"] == sum(os.path.getsize(p) for p in everything)
    # one record per folder (~400) plus one folder's listing per thread in flight, against ~100k dicts
    assert walked_peak < 12e6 and walked_peak * 5 < find_peak, (walked_peak, find_peak)


def test_the_fingerprint_changes_with_any_file_and_only_then(big_folder: Path) -> None:
    spec = SourceSpec("big", "imagefolder", str(big_folder))
    before = observe_source(spec)["fingerprint"]
    assert observe_source(spec)["fingerprint"] == before
    victim = big_folder / "shard-07" / "part-0140" / "00100.jpg"
    victim.rename(victim.with_name("00100b.jpg"))
    renamed = observe_source(spec)["fingerprint"]
    victim.with_name("00100b.jpg").rename(victim)
    assert observe_source(spec)["fingerprint"] == before
    caption = big_folder / "shard-19" / "part-0399" / "00000.txt"
    caption.write_text("another caption")
    resized = observe_source(spec)["fingerprint"]
    caption.write_text("a caption")
    assert len({before, renamed, resized}) == 3


def test_ray_workers_list_the_same_folders_as_threads(big_folder: Path, ray_cluster) -> None:
    on_threads = walk_folders(str(big_folder), None, batch=7, threads=3)
    assert ray_cluster.is_initialized()
    on_ray = walk_folders(str(big_folder), None, batch=7)
    assert on_ray == on_threads and len(on_ray) == 1 + FOLDERS // 20 + FOLDERS


def test_an_s3_folder_is_walked_and_its_listings_are_not_kept(s3_endpoint: dict) -> None:
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1")
    client.create_bucket(Bucket="walk")
    keys = [f"photos/{a}/{b}/{i}.jpg" for a in ("x", "y") for b in ("p", "q", "r") for i in range(5)]
    for key in keys + ["photos/x/notes.txt", "photos/top.png"]:
        client.put_object(Bucket="walk", Key=key, Body=b"12345")
    options = s3_endpoint["storage_options"]
    got = list_folders("s3://walk/photos", options)
    assert got == [("s3://walk/photos", 5)] + sorted(
        (f"s3://walk/photos/{a}/{b}", 25) for a in ("x", "y") for b in ("p", "q", "r"))
    fs = filesystem_for("s3://walk/photos", options)
    assert not [path for path in fs.dircache if path.startswith("walk/photos")]
    seen = observe_source(SourceSpec("s3walk", "imagefolder", "s3://walk/photos"), options)
    assert (seen["files"], seen["bytes"], seen["fragments"]) == (len(keys) + 2, 5 * (len(keys) + 2), 7)
