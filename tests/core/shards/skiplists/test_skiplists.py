"""Skip-lists: round trip of the binary format, memory-mapped reads, whole-source replacement,
validation, union of reasons, S3."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import boto3
import numpy as np
import pyarrow.parquet as pq
import pytest

from prx_core.shards.skiplists.files import (
    MAGIC,
    REASONS,
    SkipList,
    open_indices,
    read_skip_lists,
    skiplist_uri,
    skipped_indices,
)
from prx_core.shards.skiplists.publish import write_skip_lists


def skip(reason: str, indices: list[int], source: str = "alpha", bucket: tuple[int, int, int] = (512, 512, 512),
         size: int = 100, policy: str = "p1") -> SkipList:
    return SkipList(source, *bucket, reason, policy, tuple(indices), tuple(f"{source}-{i:04d}" for i in indices), size,
                    "d" * 64)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_round_trip_and_file_format(tmp_path) -> None:
    lists = [skip("nsfw", [3, 7]), skip("duplicate", [1, 3, 50]), skip("text", [0], bucket=(1024, 1248, 784), size=4)]
    written = write_skip_lists(str(tmp_path), "alpha", lists)
    assert [w.split("/skiplists/")[1] for w in written] == [
        "alpha/512/512x512/duplicate.skip", "alpha/512/512x512/nsfw.skip", "alpha/1024/1248x784/text.skip"]
    assert skiplist_uri(str(tmp_path), "alpha", 512, 512, 512, "nsfw") == str(tmp_path / "skiplists/alpha/512/512x512/nsfw.skip")
    assert read_skip_lists(str(tmp_path)) == sorted(lists, key=lambda s: (s.tier, s.width, s.height, s.reason))
    # the format, parsed by hand: magic, u32 header length, JSON header padded to 8 bytes, int64 LE
    data = (tmp_path / "skiplists/alpha/512/512x512/duplicate.skip").read_bytes()
    assert data[:8] == MAGIC
    (length,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12:12 + length])
    assert (12 + length) % 8 == 0
    assert header == {**header, "reason": "duplicate", "policy_version": "p1", "stream": "alpha/512/512x512",
                      "stream_size": 100, "count": 3, "created_by": "prx-corpus", "index_digest": "d" * 64}
    assert np.frombuffer(data[12 + length:], "<i8").tolist() == [1, 3, 50]
    ids = pq.read_table(tmp_path / "skiplists/alpha/512/512x512/duplicate.ids.parquet").to_pylist()
    assert ids == [{"index": i, "sample_id": f"alpha-{i:04d}"} for i in (1, 3, 50)]
    mapped_header, mapped = open_indices(str(tmp_path / "skiplists/alpha/512/512x512/duplicate.skip"))
    assert isinstance(mapped, np.memmap) and mapped.tolist() == [1, 3, 50] and mapped_header == header
    assert lists[1].fraction == pytest.approx(0.03) and lists[2].fraction == 0.25
    assert skipped_indices(str(tmp_path), "alpha", 512, 512, 512) == {1, 3, 7, 50}
    assert skipped_indices(str(tmp_path), "alpha", 1024, 1248, 784) == {0}
    assert skipped_indices(str(tmp_path), "alpha", 512, 576, 448) == set()
    assert skipped_indices(str(tmp_path), "nobody", 512, 512, 512) == set()
    assert [s.reason for s in read_skip_lists(str(tmp_path), tier=1024)] == ["text"]  # one tier only
    assert read_skip_lists(str(tmp_path), tier=1024, with_sample_ids=False)[0].sample_ids == ()


def test_a_large_list_is_mapped_not_loaded(tmp_path) -> None:
    indices = np.arange(0, 2_000_000, 3, dtype=np.int64)
    big = SkipList("alpha", 512, 512, 512, "duplicate", "p1", indices, [f"s{i}" for i in indices], 2_000_000, "d" * 64)
    write_skip_lists(str(tmp_path), "alpha", [big])
    header, mapped = open_indices(str(tmp_path / "skiplists/alpha/512/512x512/duplicate.skip"))
    assert header["count"] == len(indices) and np.array_equal(mapped, indices) and mapped.base is not None


def test_rewrite_replaces_the_source_and_removes_stale_files(tmp_path) -> None:
    root = str(tmp_path)
    write_skip_lists(root, "beta", [skip("duplicate", [2], source="beta")])
    beta = (tmp_path / "skiplists/beta/512/512x512/duplicate.skip").read_bytes()
    write_skip_lists(root, "alpha", [skip("nsfw", [3]), skip("text", [4]), skip("opt_out", [9], bucket=(512, 576, 448))])
    leftover = tmp_path / "skiplists/alpha/512/512x512/.nsfw.skip.0123.tmp"  # a crashed earlier write
    leftover.write_text("{")
    first = files(tmp_path)
    written = write_skip_lists(root, "alpha", [skip("nsfw", [3, 5], policy="p2"), skip("text", [])])
    assert written == [skiplist_uri(root, "alpha", 512, 512, 512, "nsfw")]
    assert files(tmp_path) == ["skiplists/alpha/512/512x512/_complete.json", "skiplists/alpha/512/512x512/nsfw.ids.parquet",
                               "skiplists/alpha/512/512x512/nsfw.skip", "skiplists/beta/512/512x512/_complete.json",
                               "skiplists/beta/512/512x512/duplicate.ids.parquet", "skiplists/beta/512/512x512/duplicate.skip"]
    assert len(first) == 12 and not (tmp_path / "skiplists/alpha/512/576x448").exists()  # 9 + 3 records
    record = json.loads((tmp_path / "skiplists/alpha/512/512x512/_complete.json").read_text())
    assert record["counts"] == {"nsfw": 2} and record["reasons_applied"] == ["nsfw", "text"]
    assert read_skip_lists(root, "alpha") == [skip("nsfw", [3, 5], policy="p2")]
    assert (tmp_path / "skiplists/beta/512/512x512/duplicate.skip").read_bytes() == beta
    assert skipped_indices(root, "alpha", 512, 512, 512) == {3, 5}
    assert write_skip_lists(root, "alpha", []) == [] and read_skip_lists(root, "alpha") == []
    assert [s.source for s in read_skip_lists(root)] == ["beta"]


def test_rerun_writes_identical_bytes(tmp_path) -> None:
    lists = [skip(r, [i, i + 10]) for i, r in enumerate(REASONS)]
    write_skip_lists(str(tmp_path), "alpha", lists)
    before = {f: (tmp_path / f).read_bytes() for f in files(tmp_path)}
    write_skip_lists(str(tmp_path), "alpha", list(reversed(lists)))
    assert {f: (tmp_path / f).read_bytes() for f in files(tmp_path)} == before


@pytest.mark.parametrize("bad, message", [
    (skip("spam", [1]), "unknown reason"),
    (skip("nsfw", [5, 3]), "sorted, unique"),
    (skip("nsfw", [3, 3]), "sorted, unique"),
    (skip("nsfw", [100]), r"\[0, 100\)"),
    (skip("nsfw", [-1]), r"\[0, 100\)"),
    (replace(skip("nsfw", [1, 2]), sample_ids=("a",)), "2 indices but 1 sample_ids"),
    (skip("nsfw", [1], source="beta"), "source is not 'alpha'"),
    (skip("nsfw", [1], policy=""), "policy_version"),
])
def test_invalid_lists_are_refused_before_anything_is_written(tmp_path, bad: SkipList, message: str) -> None:
    write_skip_lists(str(tmp_path), "alpha", [skip("text", [1])])
    before = files(tmp_path)
    with pytest.raises(ValueError, match=message):
        write_skip_lists(str(tmp_path), "alpha", [skip("duplicate", [2]), bad])
    assert files(tmp_path) == before


def test_same_stream_and_reason_twice_and_misplaced_files_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="given twice"):
        write_skip_lists(str(tmp_path), "alpha", [skip("nsfw", [1]), skip("nsfw", [2])])
    write_skip_lists(str(tmp_path), "alpha", [skip("nsfw", [1])])
    target = tmp_path / "skiplists/alpha/512/512x512/text.skip"
    target.write_bytes((tmp_path / "skiplists/alpha/512/512x512/nsfw.skip").read_bytes())
    with pytest.raises(ValueError, match="misplaced"):
        read_skip_lists(str(tmp_path))
    target.write_text('{"header": {}}')
    with pytest.raises(ValueError, match="not a skip-list file"):
        skipped_indices(str(tmp_path), "alpha", 512, 512, 512)


def test_skip_lists_on_s3(s3_endpoint) -> None:
    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="skips")
    root = "s3://skips/corpus"
    write_skip_lists(root, "beta", [skip("text", [0], source="beta")], options)
    lists = [skip("nsfw", [3, 7]), skip("duplicate", [1, 3]), skip("opt_out", [2], bucket=(512, 448, 576))]
    written = write_skip_lists(root, "alpha", lists, options)
    assert written[0].startswith("s3://skips/corpus/skiplists/alpha/512/")
    assert read_skip_lists(root, "alpha", options) == sorted(lists, key=lambda s: (s.tier, s.width, s.height, s.reason))
    assert skipped_indices(root, "alpha", 512, 512, 512, options) == {1, 3, 7}
    write_skip_lists(root, "alpha", [skip("nsfw", [4])], options)
    assert read_skip_lists(root, "alpha", options) == [skip("nsfw", [4])]
    assert [s.source for s in read_skip_lists(root, storage_options=options)] == ["alpha", "beta"]
    assert skipped_indices(root, "alpha", 512, 448, 576, options) == set()
