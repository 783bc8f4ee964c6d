"""Synthetic `phashes` rows for the duplicates tests: pictures with match keys and signatures that
behave as real copies do (prx_core.image.fingerprint), so the runs can be checked against the
in-process reference on tables of any shape.

A picture is a number; its copies share most of its seven keys (each copy drops a few, as real
copies do at one or two rank boundaries) and carry its signature with a grey level of noise; two
pictures never confirm each other. `LOOKALIKE` pictures share a key with another picture
without looking like it: a candidate the signatures must refuse.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from prx_core.image.fingerprint import SIGNATURE_BYTES
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_partition, source_predicate
from prx_core.store.storage import Storage

BIG = 2**63 + 12345  # above int64: uint64 end to end
LOOKALIKE = 1000  # pictures >= this share their first key with picture (n - LOOKALIKE)


def picture_keys(picture: int) -> list[int]:
    base = [(picture * 7919 + k) * 2654435761 % 2**64 or 1 for k in range(7)]
    if picture >= LOOKALIKE:
        base[0] = picture_keys(picture - LOOKALIKE)[0]
    return base


def picture_signature(picture: int, copy: int = 0) -> bytes:
    """The picture's 16x16 luma and 8x8 chroma (a smooth random field), with a level of noise per copy."""
    rng = np.random.default_rng(picture)
    luma = np.kron(rng.integers(20, 235, (4, 4)), np.ones((4, 4)))
    chroma = np.kron(rng.integers(60, 196, (2, 4, 4)), np.ones((1, 2, 2)))
    sig = np.concatenate([luma.ravel(), chroma.ravel()]).astype(np.int16)
    if copy:
        sig += np.random.default_rng(picture * 1000 + copy).integers(-1, 2, sig.shape)
    assert sig.size == SIGNATURE_BYTES
    return np.clip(sig, 0, 255).astype(np.uint8).tobytes()


def row(source: str, key: str, picture: int, copy: int, pixels: int, quality: int | None, size: int,
        lossless: bool = False) -> dict:
    keys = picture_keys(picture)
    if copy:  # a copy misses a key or two of its picture's (another rank boundary moved)
        rng = np.random.default_rng(picture * 31 + copy)
        for k in rng.choice(7, size=int(rng.integers(0, 3)), replace=False):
            keys[k] = int(rng.integers(1, 2**63))
    phash = BIG + picture if picture % 2 else picture + 17
    return {"sample_id": f"{source}/{key}", "source": source, "phash": phash, "width": 1, "height": 1,
            "pixels": pixels, "jpeg_quality": quality, "num_bytes": size, "match_keys": keys,
            "signature": picture_signature(picture, copy), "lossless": lossless}


def phash_rows(source: str, items: list[tuple]) -> pa.Table:
    """PHASHES rows from (key, picture, copy, pixels, jpeg_quality, num_bytes[, lossless])."""
    return pa.Table.from_pylist([row(source, *item) for item in items], schema=schemas.PHASHES)


def random_items(seed: int, n: int, pictures: int = 9) -> list[tuple]:
    """Copies of a few pictures (groups across sources and units), few sizes and qualities (ties)."""
    rng = np.random.default_rng(seed)
    return [(f"r{i:03d}", int(rng.integers(pictures)), int(rng.integers(1, 50)), [100, 400][rng.integers(2)],
             [None, 80, 95][rng.integers(3)], [10, 20][rng.integers(2)]) for i in range(n)]


def write_source(storage: Storage, source: str, items: list[tuple], fragments: int = 2) -> None:
    """Replace `source`'s phashes rows, written as `fragments` fragments."""
    rows, uri = phash_rows(source, items), storage.lance_uri("phashes")
    step = max(1, -(-rows.num_rows // fragments))
    written = [f for i in range(0, rows.num_rows, step) for f in lance_io.write_fragments(uri, rows.slice(i, step),
                                                                                           schemas.PHASHES)]
    commit_partition(storage, "phashes", source_predicate(source), written)
