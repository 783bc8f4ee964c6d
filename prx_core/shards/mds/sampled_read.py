"""A budgeted read-back of one MDS shard: its size, its sample count and a few of its samples,
fetched by byte range, instead of the whole shard downloaded and every image decoded.

Reading every shard back re-reads what was just written: 18.5 TB for a 100M-image source. The
writer already hashed each shard as it wrote it (the xxh64 in index.json) and each chunk
recorded the SHA-256 of every image it encoded, so what a read-back adds is proof that the
object store holds what index.json describes: the object's size, the shard's own header, and a
sample of its rows decoded and compared with the record. An MDS shard starts with its sample
count (uint32) and the `count + 1` byte offsets of its samples (uint32), so each of those is one
ranged GET.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from prx_core.shards.mds.read import ShardReport, check_image, split_columns
from prx_core.shards.mds.streams import BUCKET_FOLDER
from prx_core.store.storage import filesystem_for, join_uri

SAMPLE_ROWS = 8  # samples decoded per shard (plus its first and last)


def verify_shard_sample(stream: str, info: dict, storage_options: dict | None = None,
                        expected_sha256: list[str] | None = None, expected_quality: int | None = None,
                        sample_rows: int = SAMPLE_ROWS, max_problems: int = 20) -> tuple[ShardReport, int]:
    """The shard's size and header against index.json, and `sample_rows` of its samples (chosen
    by the shard's name, so a rerun reads the same ones) checked as `verify_shard` checks every
    one; with the bytes read."""
    raw = info["raw_data"]
    name, samples = raw["basename"], int(info["samples"])
    report = ShardReport(name, samples, True, [])
    uri = join_uri(stream, name)
    fs = filesystem_for(uri, storage_options)
    size = int(fs.size(uri))
    if size != int(raw["bytes"]):
        report.hash_ok = False
        report.problems.append(f"{name}: the stored object holds {size} bytes, index.json says {raw['bytes']}")
        return report, 0
    header = fs.cat_file(uri, start=0, end=4 * (samples + 2))
    count = int(np.frombuffer(header[:4], np.uint32)[0])
    if count != samples:
        report.problems.append(f"{name}: the shard holds {count} samples, index.json says {samples}")
        return report, len(header)
    offsets = np.frombuffer(header[4:4 * (samples + 2)], np.uint32).astype(np.int64)
    picked = sample_positions(name, samples, sample_rows)
    blobs = fs.cat_ranges([uri] * len(picked), [int(offsets[i]) for i in picked], [int(offsets[i + 1]) for i in picked])
    bucket = BUCKET_FOLDER.fullmatch(stream.rstrip("/").rsplit("/", 1)[-1])
    for position, data in zip(picked, blobs):
        row = split_columns(data, info["column_names"], info["column_sizes"])
        problem = check_image(row, bucket, expected_quality)
        digest = hashlib.sha256(row["image"]).hexdigest()
        if problem is None and expected_sha256 is not None and digest != expected_sha256[position]:
            problem = "stored image bytes differ from the chunk's record"
        if problem and len(report.problems) < max_problems:
            report.problems.append(f"{name} sample {position}: {problem}")
    return report, len(header) + sum(len(b) for b in blobs)


def sample_positions(name: str, samples: int, rows: int) -> list[int]:
    """The first and last sample and `rows` others, the same for the same shard name."""
    if samples <= rows + 2:
        return list(range(samples))
    chosen = random.Random(name).sample(range(1, samples - 1), rows)
    return sorted({0, samples - 1, *chosen})

