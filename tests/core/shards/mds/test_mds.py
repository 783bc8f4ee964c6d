"""MDS streams: real shards written, then read back by mosaicml-streaming itself.

Stored images are also parsed straight from the shard bytes (the MDS layout, by hand) so a bug in
`prx_core.shards.mds.streams`'s reading helpers cannot hide a bug in its writer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import boto3
import numpy as np
import pytest
import s3fs
import streaming
from PIL import Image
from skimage import data as skdata
from streaming.base.format.mds.encodings import mds_encode
from streaming.base.util import clean_stale_shared_memory

from prx_core.image.imaging import encode_jpeg
from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.shards.mds.publish import publish_stream, write_source_streams
from prx_core.shards.mds.read import read_stream_rows, verify_stream
from prx_core.shards.mds.retention import prune_streams
from prx_core.shards.mds.streams import (
    HASHES,
    MDS_COLUMNS,
    SIZE_LIMIT,
    list_streams,
    stream_name,
    stream_uri,
    write_chunk,
)

B512, B576, B448, B1024 = (512, 512, 512), (512, 576, 448), (512, 448, 576), (1024, 1024, 1024)


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    names = ("astronaut", "chelsea", "coffee", "rocket", "camera")
    return [Image.fromarray(getattr(skdata, n)()).convert("RGB") for n in names]


def make_rows(photos: list[Image.Image], buckets: list[tuple[int, int, int]], source: str = "alpha") -> list[dict]:
    """One row per entry of `buckets`, sample ids in order, every JPEG distinct."""
    rows = []
    for i, (tier, w, h) in enumerate(buckets):
        photo = photos[i % len(photos)]
        crop = photo.crop((i % 11, i % 7, photo.width - i % 5, photo.height))
        jpeg = encode_jpeg(crop.resize((w, h), Image.Resampling.LANCZOS))
        rows.append({"tier": tier, "bucket_width": w, "bucket_height": h, "jpeg": jpeg,
                     "caption": f"A photo number {i} of {source}.", "original_caption": f"orig {i}",
                     "width": w, "height": h, "original_width": photo.width, "original_height": photo.height,
                     "sample_id": f"{source}-{i:04d}", "source": source})
    return rows


def parse_shards(stream_dir: str) -> list[dict]:
    """Rows of a local stream, decoded by hand from the MDS shard layout (images as raw bytes)."""
    index = json.loads(Path(stream_dir, "index.json").read_text())
    rows = []
    for shard in index["shards"]:
        blob = Path(stream_dir, shard["raw_data"]["basename"]).read_bytes()
        n = int(np.frombuffer(blob[:4], np.uint32)[0])
        offsets = np.frombuffer(blob[4:8 + 4 * n], np.uint32)
        for begin, end in zip(offsets[:-1], offsets[1:]):
            sample, pos, row = blob[begin:end], 0, {}
            sizes = []
            for size in shard["column_sizes"]:
                if size is None:
                    size, pos = int(np.frombuffer(sample[pos:pos + 4], np.uint32)[0]), pos + 4
                sizes.append(size)
            for name, enc, size in zip(shard["column_names"], shard["column_encodings"], sizes):
                raw = sample[pos:pos + size]
                row[name] = raw if enc == "jpeg" else raw.decode() if enc == "str" else int.from_bytes(raw, "little", signed=True)
                pos += size
            rows.append(row)
    return rows


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_names_and_uris() -> None:
    assert stream_name(1024, 1248, 784) == "1024/1248x784"
    assert stream_uri("s3://b/c", "laion", 512, 576, 448) == "s3://b/c/mds/laion/512/576x448"
    assert stream_uri("/data/c/", "laion", 512, 512, 512) == "/data/c/mds/laion/512/512x512"


def test_stored_bytes_identical_and_index_as_contracted(photos, tmp_path) -> None:
    rows = make_rows(photos, [B512, B576, B448, B512, B576, B512])
    summaries = write_source_streams(rows, str(tmp_path), "alpha")
    stored = {r["sample_id"]: r["image"] for uri in list_streams(str(tmp_path)) for r in parse_shards(uri)}
    assert {k: sha(v) for k, v in stored.items()} == {r["sample_id"]: sha(r["jpeg"]) for r in rows}
    assert all(stored[r["sample_id"]] == r["jpeg"] for r in rows)
    by_id = {r["sample_id"]: sha(r["jpeg"]) for r in rows}
    for s in summaries:
        assert s.image_sha256 == [by_id[i] for i in s.sample_ids] and s.shards == 1
        index = json.loads(Path(s.uri, "index.json").read_text())
        assert index["version"] == 2 and len(index["shards"]) == 1
        shard = index["shards"][0]
        assert dict(zip(shard["column_names"], shard["column_encodings"])) == MDS_COLUMNS
        assert shard["hashes"] == HASHES == ["xxh64"] and set(shard["raw_data"]["hashes"]) == {"xxh64"}
        assert shard["size_limit"] == SIZE_LIMIT and shard["compression"] is None
        assert s.bytes == shard["raw_data"]["bytes"] == os.path.getsize(Path(s.uri, shard["raw_data"]["basename"]))


def test_control_stock_jpeg_encoding_is_not_byte_identical(photos) -> None:
    """The pitfall the writer exists for: a PIL image decoded from our bytes is re-saved at q75."""
    jpeg = make_rows(photos, [B512])[0]["jpeg"]
    assert estimate_jpeg_quality(jpeg) == 92
    reencoded = mds_encode("jpeg", Image.open(io.BytesIO(jpeg)))
    assert sha(reencoded) != sha(jpeg) and estimate_jpeg_quality(reencoded) == 75


def test_interleaved_buckets_land_in_their_streams_in_order(photos, tmp_path) -> None:
    order = [B512, B576, B1024, B448, B512, B512, B448, B576, B1024, B512]
    rows = make_rows(photos, order)
    summaries = write_source_streams(rows, str(tmp_path), "alpha")
    keys = sorted(set(order))
    assert [(s.tier, s.width, s.height) for s in summaries] == keys
    assert list_streams(str(tmp_path)) == [stream_uri(str(tmp_path), "alpha", *k) for k in keys]
    for s in summaries:
        expected = [r for r in rows if (r["tier"], r["bucket_width"], r["bucket_height"]) == (s.tier, s.width, s.height)]
        got = parse_shards(s.uri)
        assert [r["sample_id"] for r in got] == [r["sample_id"] for r in expected] == s.sample_ids
        assert [r["caption"] for r in got] == [r["caption"] for r in expected]
        assert all((r["width"], r["height"], r["source"]) == (s.width, s.height, "alpha") for r in got)
        assert [r["sample_id"] for r in read_stream_rows(s.uri, ["sample_id"])] == s.sample_ids
    assert not (tmp_path / "mds" / ".staging").exists()


def test_grouped_rows_give_the_same_streams_and_ungrouped_input_is_refused(photos, tmp_path) -> None:
    order = [B512, B512, B576, B1024, B1024, B448]
    rows = make_rows(photos, order)
    write_source_streams(rows, str(tmp_path / "a"), "alpha")
    write_source_streams(rows, str(tmp_path / "b"), "alpha", grouped=True)  # finishes each stream early
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")
    with pytest.raises(ValueError, match="not grouped"):
        write_source_streams(rows + rows[:1], str(tmp_path / "c"), "alpha", grouped=True)
    assert list_streams(str(tmp_path / "c")) == []  # nothing published from a refused write


def test_rerun_is_byte_identical(photos, tmp_path) -> None:
    rows = make_rows(photos, [B512, B576, B448, B512])
    write_source_streams(rows, str(tmp_path), "alpha")
    first = snapshot(tmp_path)
    write_source_streams(rows, str(tmp_path), "alpha")
    assert snapshot(tmp_path) == first and any(k.endswith("index.json") for k in first)


def test_rerun_with_fewer_buckets_unpublishes_stale_streams_only_of_that_source(photos, tmp_path) -> None:
    root = str(tmp_path)
    write_source_streams(make_rows(photos, [B512, B448], source="beta"), root, "beta")
    beta = snapshot(tmp_path / "mds" / "beta")
    write_source_streams(make_rows(photos, [B512, B576, B448, B1024]), root, "alpha")
    summaries = write_source_streams(make_rows(photos, [B512, B576, B512]), root, "alpha")
    assert list_streams(root, "alpha") == [s.uri for s in summaries]
    assert [(s.tier, s.width, s.height, s.count) for s in summaries] == [(*B512, 2), (*B576, 1)]
    assert not (tmp_path / "mds" / "alpha" / "1024" / "1024x1024" / "index.json").exists()  # unpublished...
    assert list((tmp_path / "mds" / "alpha" / "1024" / "1024x1024").iterdir())  # ...its chunks kept for old readers
    assert snapshot(tmp_path / "mds" / "beta") == beta
    assert write_source_streams([], root, "alpha") == []
    assert list_streams(root, "alpha") == [] and snapshot(tmp_path / "mds" / "beta") == beta
    assert len(list_streams(root)) == 2
    report = prune_streams(root, retention_seconds=0)  # compact_corpus with the retention over
    assert not (tmp_path / "mds" / "alpha").exists() or not any(p.is_file() for p in (tmp_path / "mds" / "alpha").rglob("*"))
    assert snapshot(tmp_path / "mds" / "beta") == beta and report.removed


def test_prune_keeps_what_an_index_references_and_what_is_recent(photos, tmp_path) -> None:
    root = str(tmp_path)
    write_source_streams(make_rows(photos, [B512, B512]), root, "alpha")
    old = snapshot(tmp_path)
    summaries = write_source_streams(make_rows(photos, [B512, B512, B512]), root, "alpha")  # republished
    (stream,) = summaries
    chunks = sorted(p.name for p in Path(stream.uri).iterdir() if p.is_dir())
    assert len(chunks) == 2 and stream.chunks[0] in chunks  # the superseded chunk is still there
    assert prune_streams(root).kept_recent == 1  # within the default retention: kept
    assert all(snapshot(tmp_path).get(k) == v for k, v in old.items() if not k.endswith("index.json"))
    Path(stream.uri, "shard.00000.mds").write_bytes(b"pre-chunk layout leftover")
    report = prune_streams(root, retention_seconds=0)
    assert sorted(Path(r).name for r in report.removed) == sorted([*(set(chunks) - set(stream.chunks)), "shard.00000.mds"])
    assert sorted(p.name for p in Path(stream.uri).iterdir()) == sorted([*stream.chunks, "index.json"])
    assert verify_stream(stream.uri, expected_sha256=stream.image_sha256).ok


def test_many_shards_keep_order_and_verify(photos, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("prx_core.shards.mds.streams.SIZE_LIMIT", 250_000)  # ~3 images per shard
    rows = make_rows(photos, [B512] * 10)
    (summary,) = write_source_streams(rows, str(tmp_path), "alpha")
    assert summary.shards >= 3 and summary.sample_ids == [r["sample_id"] for r in rows]
    assert [sha(r["image"]) for r in parse_shards(summary.uri)] == [sha(r["jpeg"]) for r in rows]
    report = verify_stream(summary.uri, expected_sha256=summary.image_sha256)
    assert report.ok and report.count == 10


def test_failed_write_leaves_published_streams_untouched(photos, tmp_path) -> None:
    root = str(tmp_path)
    write_source_streams(make_rows(photos, [B512, B576]), root, "alpha")
    before = snapshot(tmp_path)
    rows = make_rows(photos, [B512, B448, B512])
    rows[2]["width"] = 500  # does not match its bucket: the write must fail before publishing
    with pytest.raises(ValueError, match="does not match"):
        write_source_streams(rows, root, "alpha")
    assert snapshot(tmp_path) == before
    rows[2]["jpeg"] = "not bytes"
    rows[2]["width"] = 512
    with pytest.raises(TypeError, match="must be the encoded bytes"):
        write_source_streams(rows, root, "alpha")
    published = {k: v for k, v in snapshot(tmp_path).items() if k in before}
    assert published == before  # a chunk may have been written, nothing published changed
    assert not [p for p in Path(tmp_path).rglob(".*") if p.name.startswith(".c-")]  # no temp folder left
    rows[2]["jpeg"] = make_rows(photos, [B512, B448, B512])[2]["jpeg"]
    write_source_streams(rows, root, "alpha")
    assert [sha(r["image"]) for r in parse_shards(stream_uri(root, "alpha", *B512))] == \
        [sha(rows[0]["jpeg"]), sha(rows[2]["jpeg"])]
    assert list_streams(root) == [stream_uri(root, "alpha", *k) for k in (B448, B512)]


def test_an_incomplete_chunk_folder_is_rewritten_and_a_complete_one_reused(photos, tmp_path) -> None:
    root = str(tmp_path)
    rows = make_rows(photos, [B512, B512])
    (first,) = write_source_streams(rows, root, "alpha")
    folder = Path(first.uri, first.chunks[0])
    (folder / "index.json").unlink()  # a writer that died before its last step
    (folder / "shard.00000.mds").write_bytes(b"half written")
    (again,) = write_source_streams(rows, root, "alpha")
    assert again.chunks == first.chunks and verify_stream(again.uri, expected_sha256=again.image_sha256).ok
    mtime = (folder / "shard.00000.mds").stat().st_mtime_ns
    write_source_streams(rows, root, "alpha")
    assert (folder / "shard.00000.mds").stat().st_mtime_ns == mtime  # complete: reused, never rewritten


def test_merged_index_is_what_streamings_merge_index_writes(photos, tmp_path) -> None:
    from streaming.base.util import merge_index

    rows = make_rows(photos, [B512] * 4)
    stream = tmp_path / "s"
    write_chunk(rows[:2], str(stream / "c-a"))
    write_chunk(rows[2:], str(stream / "c-b"))
    merge_index([str(stream / "c-a" / "index.json"), str(stream / "c-b" / "index.json")], str(tmp_path / "ref"))
    reference = json.loads((tmp_path / "ref" / "index.json").read_text())
    assert publish_stream(str(stream), ["c-a", "c-b"]) == 4
    assert json.loads((stream / "index.json").read_text()) == reference
    assert [r["sample_id"] for r in read_stream_rows(str(stream))] == [r["sample_id"] for r in rows]


def test_trainer_style_loader_reads_every_sample(photos, tmp_path) -> None:
    """How the PRX trainer reads: each bucket folder of a tier is one local Stream."""
    rows = make_rows(photos, [B512, B576, B448, B576, B448, B512, B512, B576, B448, B512, B576, B448])
    write_source_streams(rows, str(tmp_path), "alpha")
    tier_dir = tmp_path / "mds" / "alpha" / "512"
    folders = sorted(str(p) for p in tier_dir.iterdir() if (p / "index.json").exists())
    clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(streams=[streaming.Stream(local=f) for f in folders],
                                         batch_size=2, shuffle=False, batching_method="per_stream")
    samples = [dataset[i] for i in range(dataset.num_samples)] + list(dataset)
    del dataset
    by_id = {r["sample_id"]: r for r in rows}
    iterated = samples[len(rows):]
    assert sorted(s["sample_id"] for s in iterated) == sorted(by_id)
    for a, b in zip(iterated[::2], iterated[1::2]):  # per_stream: every batch is one bucket
        assert a["image"].size == b["image"].size
    for s in samples:
        assert isinstance(s["image"], Image.Image) and s["image"].format == "JPEG"
        assert s["image"].size == (s["width"], s["height"]) == (by_id[s["sample_id"]]["width"], by_id[s["sample_id"]]["height"])
        assert s["caption"] == by_id[s["sample_id"]]["caption"]


def test_verify_stream_passes_then_catches_corruption_and_wrong_hashes(photos, tmp_path) -> None:
    rows = make_rows(photos, [B512, B512, B512])
    (summary,) = write_source_streams(rows, str(tmp_path), "alpha")
    report = verify_stream(summary.uri, expected_sha256=[sha(r["jpeg"]) for r in rows])
    assert (report.count, report.hashes_ok, report.bytes_identical, report.decoded_ok) == (3, True, True, True)
    assert report.ok and verify_stream(summary.uri).bytes_identical is None
    assert verify_stream(summary.uri, expected_quality=92).ok
    assert any("quality 92, expected 75" in p for p in verify_stream(summary.uri, expected_quality=75).problems)

    wrong = verify_stream(summary.uri, expected_sha256=[sha(r["jpeg"]) for r in reversed(rows)])
    assert wrong.hashes_ok and wrong.decoded_ok and wrong.bytes_identical is False and wrong.problems

    shard = Path(summary.uri, summary.chunks[0], "shard.00000.mds")
    blob = bytearray(shard.read_bytes())
    blob[len(blob) - 5000] ^= 0xFF  # inside the last image's entropy-coded data
    shard.write_bytes(bytes(blob))
    bad = verify_stream(summary.uri, expected_sha256=summary.image_sha256)
    assert not bad.hashes_ok and bad.bytes_identical is False and not bad.ok
    assert any("xxh64" in p for p in bad.problems)


def test_write_and_verify_on_s3(photos, s3_endpoint, tmp_path, monkeypatch) -> None:
    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="mds")
    root = "s3://mds/corpus"
    rows = make_rows(photos, [B512, B576, B448, B512, B576, B1024])
    write_source_streams(make_rows(photos, [B512], source="beta"), root, "beta", options)
    summaries = write_source_streams(rows, root, "alpha", options)
    assert list_streams(root, "alpha", options) == [s.uri for s in summaries]
    by_id = {r["sample_id"]: sha(r["jpeg"]) for r in rows}
    for s in summaries:
        assert s.uri.startswith("s3://mds/corpus/mds/alpha/")
        report = verify_stream(s.uri, options, expected_sha256=[by_id[i] for i in s.sample_ids])
        assert report.ok and report.count == s.count and report.bytes_identical, report.problems

    # the trainer can stream it from S3 with streaming's own downloader
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint["endpoint"])
    clean_stale_shared_memory()
    s = summaries[1]
    dataset = streaming.StreamingDataset(remote=s.uri, local=str(tmp_path / "cache"), batch_size=1,
                                         shuffle=False, validate_hash="xxh64")
    assert [dataset[i]["sample_id"] for i in range(dataset.num_samples)] == s.sample_ids
    assert sha(dataset[0]["image"].fp.getvalue()) == s.image_sha256[0]
    del dataset

    fewer = write_source_streams(rows[:2], root, "alpha", options)
    assert list_streams(root, "alpha", options) == [f.uri for f in fewer] and len(fewer) == 2
    assert len(list_streams(root, "beta", options)) == 1
    assert verify_stream(fewer[0].uri, options, expected_sha256=fewer[0].image_sha256).ok
    # superseded chunks on S3: kept within the retention, deleted after it, published ones never
    fs = s3fs.S3FileSystem(**options)
    before = set(fs.find("mds/corpus/mds/alpha"))
    assert prune_streams(root, storage_options=options).removed == []
    report = prune_streams(root, retention_seconds=0, storage_options=options)
    assert report.removed and all(uri.startswith("s3://mds/corpus/mds/alpha/") for uri in report.removed)
    assert set(fs.find("mds/corpus/mds/alpha")) < before
    assert verify_stream(fewer[0].uri, options, expected_sha256=fewer[0].image_sha256).ok
    assert len(list_streams(root, "beta", options)) == 1
