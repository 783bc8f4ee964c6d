"""The pure functions inside the stages: ingest, bucketing, duplicate grouping, skip policy."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from prx_core.image.buckets import bucket_sizes
from prx_core.image.fingerprint import signature_distance
from prx_core.sources.ingest import content_id, ingest_batch, inspect_image
from prx_core.sources.readers import RECORD_SCHEMA
from prx_core.stages.buckets import bucket_samples
from prx_core.stages.skip_lists.stage import SkipPolicy
from prx_core.store import schemas


def jpeg(width: int, height: int, seed: int = 0, **save: object) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR).save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


def records(*items: tuple[str, bytes, str | None]) -> pa.Table:
    return pa.Table.from_pylist([{"source_key": k, "image": d, "caption": c, "embedding": None} for k, d, c in items],
                                schema=RECORD_SCHEMA)


def test_ingest_splits_samples_and_rejects_without_losing_a_record() -> None:
    good, rotated = jpeg(640, 480), jpeg(640, 480, seed=1, exif=_exif(6))
    batch = records(("a", good, " caption "), ("b", good[: len(good) // 2], "cut"), ("c", b"", None),
                    ("d", b"<html>", "page"), ("e", rotated, None))
    samples, rejects = ingest_batch("src", batch)
    assert samples.schema == schemas.SAMPLES and rejects.schema == schemas.REJECTS
    assert samples["sample_id"].to_pylist() == ["src/a", "src/e"]
    assert dict(zip(rejects["source_key"].to_pylist(), rejects["reason"].to_pylist())) == {
        "b": "truncated", "c": "empty", "d": "not_an_image"}
    assert set(rejects["stage"].to_pylist()) == {"samples"}
    first, second = samples.to_pylist()
    assert first["content_id"] == content_id(good) and first["image"] == good and first["jpeg_quality"] == 90
    assert (first["width"], first["height"]) == (640, 480)
    assert (second["width"], second["height"], second["orientation"]) == (480, 640, 6)  # upright size


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


@pytest.mark.parametrize(("size", "reason"), [((2000, 1500), None), ((300, 300), "below_floor"), ((2000, 900), "aspect_ratio")])
def test_bucket_samples_drops_with_a_reject_row(size: tuple[int, int], reason: str | None) -> None:
    table = pa.Table.from_pylist([{"sample_id": "s/x", "source": "s", "source_key": "x", "content_id": "c",
                                   "width": size[0], "height": size[1]}])
    buckets, rejects = bucket_samples(table)
    (row,) = buckets.to_pylist()
    assert row["drop_reason"] == reason
    if reason is None:
        assert (row["bucket_width"], row["bucket_height"]) in bucket_sizes(row["tier"])
        assert row["bucket"] == f"{row['bucket_width']}x{row['bucket_height']}" and rejects.num_rows == 0
    else:
        assert row["tier"] is None and rejects["reason"].to_pylist() == [reason]
        assert rejects["stage"].to_pylist() == ["buckets"]


def test_a_copy_at_half_size_shares_a_key_and_is_confirmed_and_garbage_is_refused() -> None:
    big = Image.open(io.BytesIO(jpeg(1600, 1200, seed=3)))
    half = io.BytesIO()
    big.resize((800, 600), Image.Resampling.LANCZOS).save(half, "JPEG", quality=90)
    first, second = inspect_image(jpeg(1600, 1200, seed=3)), inspect_image(half.getvalue())
    assert (first.width, first.height, second.width, second.height) == (1600, 1200, 800, 600)
    assert isinstance(first.phash, int) and 0 <= first.phash < 2**64 and len(first.match_keys) >= 7
    assert set(first.match_keys) & set(second.match_keys) and first.phash in first.match_keys
    sigs = [np.frombuffer(f.signature, np.uint8)[None] for f in (first, second)]
    assert signature_distance(*sigs)[0] <= 1 and not first.lossless
    assert inspect_image(b"nope").reason == "not_an_image"


def test_inspect_image_decodes_cheaply_but_still_sees_truncation() -> None:
    data = jpeg(4000, 3000)
    facts = inspect_image(data)
    assert (facts.width, facts.height, facts.format) == (4000, 3000, "JPEG")
    assert inspect_image(data[: len(data) * 2 // 3]).reason == "truncated"


def test_skip_policy_version_follows_every_field() -> None:
    base = SkipPolicy()
    assert base.version() == SkipPolicy().version()
    assert len({base.version(), SkipPolicy(duplicates=False).version(), SkipPolicy(labels=("nsfw",)).version(),
                SkipPolicy(opt_out=("x",)).version()}) == 4


def test_a_corrupt_source_file_becomes_a_reject_not_a_crash(tmp_path) -> None:
    import tarfile

    from prx_core.compute.units import Manifest, Unit, UnitRun
    from prx_core.sources.catalog import SourceSpec
    from prx_core.stages.samples.ingest import ingest_unit
    from prx_core.stages.samples.losses import UNREADABLE_FRAGMENT
    from prx_core.store import lance_io
    from prx_core.store.partitions import commit_partition, rejects_predicate, source_predicate
    from prx_core.store.storage import Storage

    shards = tmp_path / "wds"
    shards.mkdir()
    good = shards / "000.tar"
    with tarfile.open(good, "w") as tar:
        for key in ("a", "b"):
            data = jpeg(640, 480, seed=ord(key))
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (shards / "001.tar").write_bytes(good.read_bytes()[:700])  # cut inside the first member
    spec = SourceSpec("wds", "webdataset", str(shards))
    storage = Storage(str(tmp_path / "corpus"))
    run = UnitRun(storage, Manifest("samples", "wds", {}, "1", {"spec": spec.to_dict(), "max_pixels": 10**8}), "t")
    summary = ingest_unit(Unit("u000000", 0, {"fragments": [str(shards / "000.tar"), str(shards / "001.tar")]}), run)
    assert (summary["rows"], summary["rejected"], summary["reasons"]) == (2, 1, {UNREADABLE_FRAGMENT: 1})
    assert summary["outputs"] and all(Path(p).is_file() for p in summary["outputs"])  # written, not committed
    commit_partition(storage, "samples", source_predicate("wds"), lance_io.fragments_from_json(summary["fragments"]))
    commit_partition(storage, "rejects", rejects_predicate("wds", "samples"),
                     lance_io.fragments_from_json(summary["rejects_fragments"]))
    assert lance_io.read_table(storage.lance_uri("samples"), ["source_key"])["source_key"].to_pylist() == ["a", "b"]
    (reject,) = lance_io.read_table(storage.lance_uri("rejects")).to_pylist()
    assert reject["reason"] == UNREADABLE_FRAGMENT
    assert reject["source_key"].endswith("001.tar") and "after 0 rows" in reject["message"]


def test_a_missing_source_is_an_error_not_an_empty_source(tmp_path) -> None:
    from prx_core.sources.catalog import SourceSpec
    from prx_core.sources.readers import list_fragments

    with pytest.raises(FileNotFoundError, match="source 'gone'"):
        list_fragments(SourceSpec("gone", "imagefolder", str(tmp_path / "nowhere")))
