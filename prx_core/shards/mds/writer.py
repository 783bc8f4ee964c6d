"""The corpus's MDS writer: the files of mosaicml-streaming's `MDSWriter` (0.13, MDS version 2,
uncompressed), byte for byte, without importing streaming for the stock columns.

Why not `MDSWriter` itself: importing streaming imports torch and transformers (~5 s of a core in
every worker process that writes a chunk: most of a small source's `mds_shards` time). The format
is small and fixed: a shard is its sample count, the samples' byte offsets (uint32), the writer's
config as sorted JSON, then the samples; index.json lists each shard's config, size and hashes.
tests/core/shards/test_mds_writer.py holds the output byte-identical to `MDSWriter` for the same samples
(several shards, text-latent columns included), and every test that reads a stream reads it with
streaming itself.

Columns `jpeg`, `str` and `int` are encoded here; a `jpeg` value is the already-encoded bytes,
stored verbatim (streaming's own `jpeg` encoder re-saves any image not opened from a named file at
Pillow's default quality 75). Any other encoding (the text latents' `bf16` and `ndarray:uint8`) is
encoded by streaming's `mds_encode`, imported only then.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

STOCK_SIZES: dict[str, int | None] = {"jpeg": None, "str": None, "int": 8}  # bytes per value; None: variable
SAMPLE_OVERHEAD = 4  # each sample's uint32 offset, counted against the size limit as streaming does


def column_size(encoding: str) -> int | None:
    if encoding in STOCK_SIZES:
        return STOCK_SIZES[encoding]
    from streaming.base.format.mds.encodings import get_mds_encoded_size, is_mds_encoding

    from prx_core.shards.mds.encodings import register_encodings

    register_encodings()
    if not is_mds_encoding(encoding):
        raise TypeError(f"column encoding {encoding!r} is not an MDS encoding")
    return get_mds_encoded_size(encoding)


def encode_value(key: str, encoding: str, value: Any) -> bytes:
    """One column's bytes, as streaming's `mds_encode` makes them (bytes pass through unchanged)."""
    if encoding == "jpeg":
        datum = bytes(value)  # a PIL image raises TypeError here: it would need re-encoding
        if not datum.startswith(b"\xff\xd8\xff"):
            raise ValueError(f"column {key!r}: bytes are not a JPEG (no SOI marker)")
        return datum
    if isinstance(value, bytes):
        return value
    if encoding == "str":
        if not isinstance(value, str):
            raise AttributeError(f"column {key!r}: `str` takes a str, got {type(value).__name__}")
        return value.encode("utf-8")
    if encoding == "int":
        if not isinstance(value, int):
            raise AttributeError(f"column {key!r}: `int` takes an int, got {type(value).__name__}")
        return np.int64(value).tobytes()
    from streaming.base.format.mds.encodings import mds_encode

    return mds_encode(encoding, value)


def file_hash(algorithm: str, data: bytes) -> str:
    """A shard's hex digest under one of streaming's hash names (hashlib's or xxhash's)."""
    if algorithm in xxhash.algorithms_available:
        return getattr(xxhash, algorithm)(data).hexdigest()
    return hashlib.new(algorithm, data).hexdigest()


class MDSShardWriter:
    """Write samples into `out` as MDS shards of at most `size_limit` bytes, then index.json at `finish`."""

    def __init__(self, columns: Mapping[str, str], out: str, hashes: list[str], size_limit: int) -> None:
        if list(hashes) != sorted(set(hashes)):
            raise ValueError(f"hashes must be unique and sorted, got {hashes}")
        if not 0 < size_limit < 2**32:
            raise ValueError(f"size_limit must be in (0, 2**32): sample offsets are uint32, got {size_limit}")
        self.out, self.hashes, self.size_limit = out, list(hashes), size_limit
        self.column_names = sorted(columns)
        self.column_encodings = [columns[name] for name in self.column_names]
        self.column_sizes = [column_size(encoding) for encoding in self.column_encodings]
        self.config = {"version": 2, "format": "mds", "compression": None, "hashes": self.hashes,
                       "size_limit": size_limit, "column_names": self.column_names,
                       "column_encodings": self.column_encodings, "column_sizes": self.column_sizes}
        self.config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._shard_bytes = self._empty_shard_bytes()
        os.makedirs(out, exist_ok=True)

    def _empty_shard_bytes(self) -> int:
        return 4 + 4 + len(self.config_data)  # the count, the final offset and the config

    def encode_sample(self, sample: Mapping[str, Any]) -> bytes:
        sizes, data = [], []
        for key, encoding, size in zip(self.column_names, self.column_encodings, self.column_sizes):
            datum = encode_value(key, encoding, sample[key])
            if size is None:
                sizes.append(len(datum))
            elif size != len(datum):
                raise KeyError(f"column {key!r}: {len(datum)} bytes, encoding {encoding} needs {size}")
            data.append(datum)
        return np.array(sizes, np.uint32).tobytes() + b"".join(data)

    def write(self, sample: Mapping[str, Any]) -> None:
        encoded = self.encode_sample(sample)
        if self.size_limit < self._shard_bytes + len(encoded) + SAMPLE_OVERHEAD:  # streaming's rule, exactly
            self._flush()
        self._samples.append(encoded)
        self._shard_bytes += len(encoded) + SAMPLE_OVERHEAD

    def finish(self) -> None:
        if self._samples:
            self._flush()
        with open(os.path.join(self.out, "index.json"), "w") as handle:
            json.dump({"version": 2, "shards": self.shards}, handle, sort_keys=True)

    def _flush(self) -> None:
        basename = f"shard.{len(self.shards):05}.mds"
        count = np.uint32(len(self._samples))
        offsets = np.array([0] + [len(s) for s in self._samples]).cumsum().astype(np.uint32)
        offsets += 4 + 4 * len(offsets) + len(self.config_data)
        data = count.tobytes() + offsets.tobytes() + self.config_data + b"".join(self._samples)
        with open(os.path.join(self.out, basename), "wb") as handle:
            handle.write(data)
        raw = {"basename": basename, "bytes": len(data), "hashes": {a: file_hash(a, data) for a in self.hashes}}
        self.shards.append({"samples": len(self._samples), "raw_data": raw, "zip_data": None, **self.config})
        self._samples, self._shard_bytes = [], self._empty_shard_bytes()
