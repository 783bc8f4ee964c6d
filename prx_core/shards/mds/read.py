"""Reading MDS streams back: raw rows in index order, and the verification the `mds_shards`
check runs (xxh64 of every shard, column encodings, byte identity of the stored JPEGs, decoded
size and quality). Works on local and remote streams (a remote one is copied to a temporary
folder first). Pure library: never imports dagster.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.shards.mds.encodings import is_text_column, register_encodings
from prx_core.shards.mds.streams import BUCKET_FOLDER, INDEX, INDEX_VERSION, MDS_COLUMNS, read_stream_index
from prx_core.shards.mds.writer import file_hash
from prx_core.store.storage import filesystem_for, is_remote, join_uri


@dataclass
class StreamReport:
    uri: str
    count: int
    hashes_ok: bool
    bytes_identical: bool | None  # None when no expected hashes were given
    decoded_ok: bool
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@contextmanager
def local_copy(uri: str, storage_options: dict | None) -> Iterator[str]:
    """A local folder holding the stream: itself, or a temporary download of a remote one (its
    index.json and the shards that index references, chunk folders included)."""
    if not is_remote(uri):
        yield os.path.abspath(uri)
        return
    fs = filesystem_for(uri, storage_options)
    tmp = tempfile.mkdtemp(prefix="prx-mds-read-")
    try:
        index = read_index(uri, storage_options)
        names = [INDEX, *(s["raw_data"]["basename"] for s in index["shards"])]
        for name in names:
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
        fs.get([join_uri(uri, n) for n in names], [os.path.join(tmp, n) for n in names])
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def iter_raw_rows(local: str, index: dict) -> Iterator[tuple[dict, dict[str, bytes]]]:
    """(shard info, raw column bytes) per sample, located by streaming's own MDSReader."""
    from streaming.base.format import reader_from_json  # imports torch (~15 s): only where shards are read

    for info in index["shards"]:
        reader = reader_from_json(local, "", info)
        for idx in range(reader.samples):
            yield info, split_columns(reader.get_sample_data(idx), reader.column_names, reader.column_sizes)


def split_columns(data: bytes, names: list[str], sizes: list[int | None]) -> dict[str, bytes]:
    """One MDS sample's raw column bytes: variable-size columns lead with their uint32 sizes."""
    lengths, pos = [], 0
    for size in sizes:
        if size is None:
            size, pos = int(np.frombuffer(data[pos:pos + 4], np.uint32)[0]), pos + 4
        lengths.append(size)
    ends = np.cumsum([pos, *lengths]).tolist()
    return {n: data[a:b] for n, a, b in zip(names, ends, ends[1:])}


def read_stream_rows(uri: str, columns: list[str] | None = None,
                     storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Rows in index order; `image` stays the raw stored JPEG bytes, other columns decoded (text
    latents to torch.bfloat16 tensors)."""
    from streaming.base.format.mds.encodings import mds_decode

    register_encodings()
    with local_copy(uri, storage_options) as local:
        with open(os.path.join(local, INDEX)) as handle:
            index = json.load(handle)
        out = []
        for info, raw in iter_raw_rows(local, index):
            encodings = dict(zip(info["column_names"], info["column_encodings"]))
            out.append({k: v if encodings[k] == "jpeg" else mds_decode(encodings[k], v)
                        for k, v in raw.items() if columns is None or k in columns})
        return out


@dataclass
class ShardReport:
    basename: str
    count: int
    hash_ok: bool
    image_sha256: list[str]
    problems: list[str] = field(default_factory=list)


def verify_shard(stream: str, info: dict, storage_options: dict | None = None, expected_sha256: list[str] | None = None,
                 expected_quality: int | None = None, max_problems: int = 20) -> ShardReport:
    """Read one shard of a published stream back (the unit of parallel verification): its xxh64
    against index.json, its column encodings, every image decoded through the stock `jpeg`
    decoder to the row's and the folder's size, the JPEG quality, and the SHA-256 of every stored
    image against `expected_sha256` (byte identity with the pipeline's encode)."""
    raw = info["raw_data"]
    report = ShardReport(raw["basename"], 0, True, [])
    bucket = BUCKET_FOLDER.fullmatch(stream.rstrip("/").rsplit("/", 1)[-1])
    with _shard_copy(stream, raw["basename"], storage_options) as local:
        columns = dict(zip(info["column_names"], info["column_encodings"]))
        extra = {k: v for k, v in columns.items() if k not in MDS_COLUMNS}
        if ({k: columns.get(k) for k in MDS_COLUMNS} != MDS_COLUMNS
                or not all(is_text_column(k, v) for k, v in extra.items())):
            report.problems.append(f"{raw['basename']}: column encodings differ from MDS_COLUMNS (plus text latents)")
        path = os.path.join(local, raw["basename"])
        data = Path(path).read_bytes() if os.path.isfile(path) else b""
        if file_hash("xxh64", data) != raw["hashes"].get("xxh64"):
            report.hash_ok = False
            report.problems.append(f"{raw['basename']}: xxh64 does not match index.json")
        try:
            for _, row in iter_raw_rows(local, {"shards": [info]}):
                report.image_sha256.append(hashlib.sha256(row["image"]).hexdigest())
                problem = check_image(row, bucket, expected_quality)
                if problem and len(report.problems) < max_problems:
                    report.problems.append(f"{raw['basename']} sample {report.count}: {problem}")
                report.count += 1
        except Exception as exc:  # a corrupted shard may break the reader itself
            report.problems.append(f"{raw['basename']}: reading samples failed: {type(exc).__name__}: {exc}")
    if report.count != info["samples"]:
        report.problems.append(f"{raw['basename']}: read {report.count} samples, index.json says {info['samples']}")
    if expected_sha256 is not None and report.image_sha256 != list(expected_sha256):
        wrong = [i for i, (a, b) in enumerate(zip(report.image_sha256, expected_sha256)) if a != b]
        report.problems.append(f"{raw['basename']}: stored image bytes differ from expected ({report.count} stored, "
                               f"{len(expected_sha256)} expected, first mismatches {wrong[:5]})")
    return report


@contextmanager
def _shard_copy(stream: str, basename: str, storage_options: dict | None) -> Iterator[str]:
    """A local folder where `basename` (relative to the stream) can be read: the stream itself, or
    a temporary download of that one shard."""
    if not is_remote(stream):
        yield os.path.abspath(stream)
        return
    tmp = tempfile.mkdtemp(prefix="prx-shard-")
    try:
        os.makedirs(os.path.dirname(os.path.join(tmp, basename)), exist_ok=True)
        filesystem_for(stream, storage_options).get_file(join_uri(stream, basename), os.path.join(tmp, basename))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_index(uri: str, storage_options: dict | None = None) -> dict:
    """A stream's index.json, or a merged member's member.json (what its source wrote)."""
    fs = filesystem_for(uri, storage_options)
    fs.invalidate_cache()
    return json.loads(read_stream_index(fs, uri))


def verify_stream(uri: str, storage_options: dict | None = None, expected_sha256: list[str] | None = None,
                  expected_quality: int | None = None) -> StreamReport:
    """`verify_shard` over every shard of a stream, in one process (small streams, tests)."""
    try:
        index = read_index(uri, storage_options)
    except (OSError, ValueError) as exc:
        return StreamReport(uri, 0, False, False if expected_sha256 is not None else None, False,
                            [f"index.json unreadable: {exc}"])
    report = StreamReport(uri, 0, True, None, True)
    if index.get("version") != INDEX_VERSION:
        report.problems.append(f"index version {index.get('version')} != {INDEX_VERSION}")
    shas: list[str] = []
    for info in index["shards"]:
        shard = verify_shard(uri, info, storage_options, expected_quality=expected_quality)
        report.hashes_ok &= shard.hash_ok
        report.decoded_ok &= not any("sample" in p or "reading" in p for p in shard.problems)
        report.problems += shard.problems
        shas += shard.image_sha256
    report.count = len(shas)
    if expected_sha256 is not None:
        report.bytes_identical = shas == list(expected_sha256)
        if not report.bytes_identical:
            wrong = [i for i, (a, b) in enumerate(zip(shas, expected_sha256)) if a != b]
            report.problems.append(f"stored image bytes differ from expected ({len(shas)} stored, "
                                   f"{len(expected_sha256)} expected, first mismatches {wrong[:5]})")
    return report


def decode_int(data: bytes) -> int:
    """streaming's `int` decoder, without importing streaming: that import pulls in torch and
    transformers (~5 s per process), paid by every worker that reads a few samples back.
    tests/core/shards/test_mds_encodings.py holds it equal to `mds_decode("int", ...)`."""
    return int(np.frombuffer(data, np.int64)[0])


def open_jpeg(data: bytes) -> Image.Image:
    """streaming's `jpeg` decoder (Pillow on the stored bytes, as the trainer opens them), without
    importing streaming; held equal to `mds_decode("jpeg", ...)` by the same test."""
    return Image.open(io.BytesIO(data))


def check_image(row: dict[str, bytes], bucket: re.Match | None, quality: int | None) -> str | None:
    """Why a stored sample is not what the loader expects (decode, size, bucket, quality), or None."""
    try:
        width, height = decode_int(row["width"]), decode_int(row["height"])
        with open_jpeg(row["image"]) as image:
            image.load()
            size, fmt = image.size, image.format
    except Exception as exc:
        return f"does not decode: {type(exc).__name__}: {exc}"
    if fmt != "JPEG" or size != (width, height):
        return f"decodes to {fmt} {size}, row says {(width, height)}"
    if bucket is not None and size != (int(bucket[1]), int(bucket[2])):
        return f"decodes to {size}, stream bucket is {bucket[0]}"
    if quality is not None and estimate_jpeg_quality(row["image"]) != quality:
        return f"JPEG quality {estimate_jpeg_quality(row['image'])}, expected {quality}"
    return None
