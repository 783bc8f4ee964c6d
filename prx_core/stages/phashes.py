"""Stage `phashes`: the 64-bit DCT pHash of every sample of a source.

The hash is taken from a DCT-scaled decode (>= 128 px, what the 32x32 Lanczos reduction with
reducing_gap 4 uses anyway), so a 12 MP photo costs a 1/8-scale decode, and an original and
its half-size copy reach the hash from nearly the same pixels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_core.compute.parallel import Progress, chunk, map_tasks, scan_partition, take_rows
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection, decode_image
from prx_core.image.phash import phash
from prx_core.store import schemas
from prx_core.store.partitions import reject_row, rejects_predicate, source_predicate, write_partition
from prx_core.store.storage import Storage

PHASH_DECODE_SIZE = (128, 128)
ROWS_PER_TASK = 256


@dataclass
class PhashesReport:
    source: str
    rows: int
    failed: int
    seconds: float
    samples_version: int
    phashes_version: int

    @property
    def images_per_second(self) -> float:
        return (self.rows + self.failed) / max(self.seconds, 1e-9)


def phash_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int] | Rejection:
    """(pHash, width, height) of upright image bytes, or why they cannot be hashed."""
    decoded = decode_image(data, max_pixels, min_size=PHASH_DECODE_SIZE)
    if isinstance(decoded, Rejection):
        return decoded
    return phash(decoded.image), *decoded.original_size


def phash_rows(task: dict[str, Any]) -> pa.Table:
    """Ray task: hash one chunk of samples; a sample that fails goes out as a reject row."""
    rows = take_rows(task["uri"], task["version"], task["addresses"], ["sample_id", "source", "source_key", "content_id", "image", "jpeg_quality", "num_bytes"], task["lance_options"])
    out: list[dict[str, Any]] = []
    for row in rows.to_pylist():
        result = phash_image(row["image"], task["max_pixels"])
        if isinstance(result, Rejection):
            out.append({"reject": reject_row(row["sample_id"], row["source"], row["source_key"], row["content_id"],
                                             "phashes", result.reason, result.message)})
            continue
        value, width, height = result
        out.append({"hash": {"sample_id": row["sample_id"], "source": row["source"], "phash": value,
                             "width": width, "height": height, "pixels": width * height,
                             "jpeg_quality": row["jpeg_quality"], "num_bytes": row["num_bytes"]}})
    schema = pa.schema([("hash", pa.struct(schemas.PHASHES)), ("reject", pa.struct(schemas.REJECTS))])
    return pa.Table.from_pylist(out, schema=schema)


def build_phashes(
    source: str, storage: Storage, max_pixels: int = DEFAULT_MAX_PIXELS, progress: Progress | None = None
) -> PhashesReport:
    start = time.monotonic()
    options = storage.lance_storage_options()
    samples_uri = storage.lance_uri("samples")
    version, index = scan_partition(samples_uri, source_predicate(source), ["sample_id"], options)
    addresses = index.sort_by("sample_id").column("_rowaddr").to_pylist()
    tasks = [{"uri": samples_uri, "version": version, "addresses": part, "lance_options": options,
              "max_pixels": max_pixels}
             for part in chunk(addresses, ROWS_PER_TASK)]
    hashes: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    for table in map_tasks(tasks, phash_rows, progress=progress):
        for row in table.to_pylist():
            (hashes if row["hash"] else rejects).append(row["hash"] or row["reject"])
    hashes.sort(key=lambda r: r["sample_id"])
    written = write_partition(storage, "phashes", source_predicate(source), pa.Table.from_pylist(hashes, schema=schemas.PHASHES))
    write_partition(storage, "rejects", rejects_predicate(source, "phashes"), pa.Table.from_pylist(rejects, schema=schemas.REJECTS))
    return PhashesReport(source, len(hashes), len(rejects), time.monotonic() - start, version, written)
