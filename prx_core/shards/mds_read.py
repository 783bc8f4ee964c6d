"""Reading MDS streams back: raw rows in index order, and the verification the `mds_shards`
check runs (xxh64 of every shard, column encodings, byte identity of the stored JPEGs, decoded
size and quality). Works on local and remote streams (a remote one is copied to a temporary
folder first). Pure library: never imports dagster.
"""

from __future__ import annotations

import hashlib
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
from streaming.base.format import reader_from_json
from streaming.base.format.mds.encodings import mds_decode
from streaming.base.hashing import get_hash

from prx_core.image.jpeg_quality import estimate_jpeg_quality
from prx_core.shards.mds import BUCKET_FOLDER, INDEX, INDEX_VERSION, MDS_COLUMNS, list_files
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
def _local_copy(uri: str, storage_options: dict | None) -> Iterator[str]:
    """A local folder holding the stream: itself, or a temporary download of a remote one."""
    if not is_remote(uri):
        yield os.path.abspath(uri)
        return
    fs = filesystem_for(uri, storage_options)
    tmp = tempfile.mkdtemp(prefix="prx-mds-read-")
    try:
        names = [rel for rel in list_files(fs, uri) if "/" not in rel]
        fs.get([join_uri(uri, n) for n in names], [os.path.join(tmp, n) for n in names])
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _iter_raw_rows(local: str, index: dict) -> Iterator[tuple[dict, dict[str, bytes]]]:
    """(shard info, raw column bytes) per sample, located by streaming's own MDSReader."""
    for info in index["shards"]:
        reader = reader_from_json(local, "", info)
        for idx in range(reader.samples):
            data, pos, sizes = reader.get_sample_data(idx), 0, []
            for size in reader.column_sizes:
                if size is None:
                    size, pos = int(np.frombuffer(data[pos:pos + 4], np.uint32)[0]), pos + 4
                sizes.append(size)
            ends = np.cumsum([pos, *sizes]).tolist()
            yield info, {n: data[a:b] for n, a, b in zip(reader.column_names, ends, ends[1:])}


def read_stream_rows(uri: str, columns: list[str] | None = None,
                     storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Rows in index order; `image` stays the raw stored JPEG bytes, other columns decoded."""
    with _local_copy(uri, storage_options) as local:
        with open(os.path.join(local, INDEX)) as handle:
            index = json.load(handle)
        out = []
        for info, raw in _iter_raw_rows(local, index):
            encodings = dict(zip(info["column_names"], info["column_encodings"]))
            out.append({k: v if encodings[k] == "jpeg" else mds_decode(encodings[k], v)
                        for k, v in raw.items() if columns is None or k in columns})
        return out


def verify_stream(uri: str, storage_options: dict | None = None, expected_sha256: list[str] | None = None,
                  expected_quality: int | None = None) -> StreamReport:
    """Read a published stream back and check it against index.json and the expected images.

    Checks the xxh64 of every shard (a local `Stream` never does), the column encodings, that each
    stored image's sha256 is the expected one (byte identity with the pipeline's encode) and that
    it decodes, through the stock `jpeg` decoder, to the row's and the folder's (width, height).
    `expected_quality` also checks each image's estimated JPEG quality (a q75 re-encode shows up
    even without expected hashes); a mismatch is listed in `problems`.
    """
    report = StreamReport(uri, 0, True, None, True)
    bucket = BUCKET_FOLDER.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])
    shas: list[str] = []
    with _local_copy(uri, storage_options) as local:
        try:
            with open(os.path.join(local, INDEX)) as handle:
                index = json.load(handle)
        except (OSError, ValueError) as exc:
            return StreamReport(uri, 0, False, False if expected_sha256 is not None else None, False,
                                [f"index.json unreadable: {exc}"])
        if index.get("version") != INDEX_VERSION:
            report.problems.append(f"index version {index.get('version')} != {INDEX_VERSION}")
        for info in index["shards"]:
            raw = info["raw_data"]
            if dict(zip(info["column_names"], info["column_encodings"])) != MDS_COLUMNS:
                report.problems.append(f"{raw['basename']}: column encodings differ from MDS_COLUMNS")
            path = os.path.join(local, raw["basename"])
            data = Path(path).read_bytes() if os.path.isfile(path) else b""
            if get_hash("xxh64", data) != raw["hashes"].get("xxh64"):
                report.hashes_ok = False
                report.problems.append(f"{raw['basename']}: xxh64 does not match index.json")
        try:
            for info, row in _iter_raw_rows(local, index):
                shas.append(hashlib.sha256(row["image"]).hexdigest())
                problem = _check_image(row, bucket, expected_quality)
                if problem:
                    report.decoded_ok = False
                    report.problems.append(f"sample {len(shas) - 1} ({info['raw_data']['basename']}): {problem}")
        except Exception as exc:  # a corrupted shard may break the reader itself
            report.decoded_ok = False
            report.problems.append(f"reading samples failed: {type(exc).__name__}: {exc}")
        report.count = len(shas)
        if report.count != sum(info["samples"] for info in index["shards"]):
            report.problems.append(f"read {report.count} samples, index.json says otherwise")
    if expected_sha256 is not None:
        report.bytes_identical = shas == list(expected_sha256)
        if not report.bytes_identical:
            wrong = [i for i, (a, b) in enumerate(zip(shas, expected_sha256)) if a != b]
            report.problems.append(f"stored image bytes differ from expected ({len(shas)} stored, "
                                   f"{len(expected_sha256)} expected, first mismatches {wrong[:5]})")
    return report


def _check_image(row: dict[str, bytes], bucket: re.Match | None, quality: int | None) -> str | None:
    try:
        width, height = mds_decode("int", row["width"]), mds_decode("int", row["height"])
        with mds_decode("jpeg", row["image"]) as image:
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
