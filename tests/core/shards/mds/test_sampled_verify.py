"""The budgeted read-back of MDS shards (prx_core.shards.mds.sampled_read) on real shards, local and
on a real S3 endpoint: a few ranged reads per shard instead of the whole shard, catching a wrong
object size, a wrong header and a sampled image that differs from the chunk's record."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from test_mds import B512, make_rows, photos  # noqa: F401  (the fixture: skimage photos as PIL images)

from prx_core.shards.mds.publish import write_source_streams
from prx_core.shards.mds.read import read_index
from prx_core.shards.mds.sampled_read import sample_positions, verify_shard_sample


def shards_with_hashes(uri: str, image_sha256: list[str], options: dict | None = None) -> list[tuple[dict, list[str]]]:
    """Each shard of the stream with the expected hashes of its own samples."""
    out, start = [], 0
    for info in read_index(uri, options)["shards"]:
        out.append((info, image_sha256[start:start + info["samples"]]))
        start += info["samples"]
    return out


@pytest.fixture()
def stream(photos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("prx_core.shards.mds.streams.SIZE_LIMIT", 1_000_000)  # 14 images per shard
    (summary,) = write_source_streams(make_rows(photos, [B512] * 30), str(tmp_path), "alpha")
    assert summary.shards >= 2
    return summary


def test_a_sampled_read_checks_a_few_samples_of_each_shard(stream) -> None:
    for info, expected in shards_with_hashes(stream.uri, stream.image_sha256):
        report, read = verify_shard_sample(stream.uri, info, expected_sha256=expected, expected_quality=92,
                                           sample_rows=2)
        assert report.problems == [] and report.count == info["samples"]
        if info["samples"] > 4:  # the header and 4 samples of 14 (a shard of 4 or fewer is read whole)
            assert 0 < read < info["raw_data"]["bytes"] / 2
    assert sample_positions("a/shard.00000.mds", 12, 2) == sample_positions("a/shard.00000.mds", 12, 2)
    assert len(sample_positions("x", 12, 2)) == 4 and sample_positions("x", 3, 2) == [0, 1, 2]


def test_a_sampled_image_unlike_its_record_a_short_object_and_a_wrong_header_are_caught(stream) -> None:
    (info, expected), *_ = shards_with_hashes(stream.uri, stream.image_sha256)
    wrong = list(expected)
    picked = sample_positions(info["raw_data"]["basename"], info["samples"], 2)
    wrong[picked[1]] = "0" * 64
    report, _ = verify_shard_sample(stream.uri, info, expected_sha256=wrong, sample_rows=2)
    assert report.problems == [f"{info['raw_data']['basename']} sample {picked[1]}: stored image bytes differ from "
                               "the chunk's record"]
    shard = Path(stream.uri, info["raw_data"]["basename"])
    blob = shard.read_bytes()
    shard.write_bytes(blob[:-10])
    report, _ = verify_shard_sample(stream.uri, info, expected_sha256=expected, sample_rows=2)
    assert "the stored object holds" in report.problems[0] and not report.hash_ok
    shard.write_bytes((info["samples"] + 1).to_bytes(4, "little") + blob[4:])
    report, _ = verify_shard_sample(stream.uri, info, expected_sha256=expected, sample_rows=2)
    assert report.problems[0].endswith(f"the shard holds {info['samples'] + 1} samples, index.json says {info['samples']}")


def test_a_sampled_read_on_s3_fetches_ranges_not_the_shard(photos, s3_endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="sampled")
    monkeypatch.setattr("prx_core.shards.mds.streams.SIZE_LIMIT", 1_000_000)
    (summary,) = write_source_streams(make_rows(photos, [B512] * 14), "s3://sampled/corpus", "alpha", options)
    for info, expected in shards_with_hashes(summary.uri, summary.image_sha256, options):
        report, read = verify_shard_sample(summary.uri, info, options, expected, 92, sample_rows=2)
        assert report.problems == [] and read < info["raw_data"]["bytes"]


def test_verify_streams_reads_each_chunk_record_once_and_counts_it(stream, ray_cluster) -> None:
    """One task per chunk: the bytes read are the shards' sampled reads plus each chunk's record once."""
    from prx_core.shards.mds.streams import CHUNK_RECORD
    from prx_core.shards.mds.verify import verify_streams

    shards = shards_with_hashes(stream.uri, stream.image_sha256)
    chunks = {info["raw_data"]["basename"].split("/", 1)[0] for info, _ in shards}
    sampled = sum(verify_shard_sample(stream.uri, info, expected_sha256=expected, expected_quality=92)[1]
                  for info, expected in shards)
    records = sum(Path(stream.uri, chunk, CHUNK_RECORD).stat().st_size for chunk in chunks)
    report = verify_streams([stream.uri])
    assert report.ok and report.shards == len(shards) > len(chunks) and report.samples == 30
    assert report.bytes_read == sampled + records
