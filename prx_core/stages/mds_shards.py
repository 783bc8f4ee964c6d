"""Stage `mds_shards`: the source's streams, resized to their buckets, JPEG q92, with captions.

Rows are planned on the driver in a fixed order (tier, bucket, sample_id), images are decoded
once each by `process_image` on Ray in that order, and `prx_core.shards.mds` writes and publishes
each stream whole. `mds_index` records every sample's position in its stream (what skip-lists
refer to) and the SHA-256 of the stored bytes (what the readback check compares).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Progress, chunk, map_tasks, scan_partition, take_rows
from prx_core.image.buckets import TIERS
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection
from prx_core.image.imaging import process_image
from prx_core.shards.mds import StreamSummary, write_source_streams
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import reject_row, rejects_predicate, source_predicate, write_partition
from prx_core.store.storage import Storage

ROWS_PER_TASK = 32
ROUTE_ROWS = 1_000_000  # rows per routing unit: sizes and ids, no pixels
CHUNK_ROWS = 50_000  # target rows per MDS chunk (one worker task, one sub-folder of a stream)
NO_CAPTION = "no_caption"
BUCKET_MISMATCH = "bucket_mismatch"
_OUT = pa.schema([
    ("sample_id", pa.string()), ("content_id", pa.string()), ("source", pa.string()), ("source_key", pa.string()),
    ("tier", pa.int32()), ("bucket_width", pa.int32()), ("bucket_height", pa.int32()), ("jpeg", pa.large_binary()),
    ("caption", pa.string()), ("original_caption", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
    ("original_width", pa.int32()), ("original_height", pa.int32()), ("reason", pa.string()), ("message", pa.string()),
])


@dataclass
class MdsReport:
    source: str
    written: int
    streams: list[StreamSummary]
    rejects: dict[str, int]
    seconds: float
    read_versions: dict[str, int] = field(default_factory=dict)
    mds_index_version: int = 0

    @property
    def images_per_second(self) -> float:
        return self.written / max(self.seconds, 1e-9)


def render_rows(task: dict[str, Any]) -> pa.Table:
    """Ray task: one decode per image -> the bucketed JPEG and the row the stream stores."""
    columns = ["sample_id", "content_id", "source", "source_key", "image", "original_caption"]
    rows = take_rows(task["uri"], task["version"], task["addresses"], columns, task["lance_options"])
    out = []
    for row, plan in zip(rows.to_pylist(), task["plans"]):
        result = process_image(row["image"], max_pixels=task["max_pixels"], max_tier=task["max_tier"])
        base = {k: row[k] for k in ("sample_id", "content_id", "source", "source_key")}
        base["original_caption"] = row["original_caption"] or ""
        if isinstance(result, Rejection):
            out.append({**base, "reason": result.reason, "message": result.message})
        elif (result.bucket.tier, result.bucket.width, result.bucket.height) != tuple(plan["bucket"]):
            out.append({**base, "reason": BUCKET_MISMATCH, "message": f"{result.bucket} != buckets table {plan['bucket']}"})
        else:
            out.append({**base, "tier": result.bucket.tier, "bucket_width": result.bucket.width,
                        "bucket_height": result.bucket.height, "jpeg": result.jpeg, "caption": plan["caption"],
                        "width": result.bucket.width, "height": result.bucket.height,
                        "original_width": result.original_size[0], "original_height": result.original_size[1]})
    return pa.Table.from_pylist(out, schema=_OUT)


def plan_rows(source: str, storage: Storage, captioner_version: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """Rows to store, in stream order, and the bucketed rows with no caption (rejected)."""
    options = storage.lance_storage_options()
    buckets = lance_io.open_table(storage.lance_uri("buckets"), options)
    captions = lance_io.open_table(storage.lance_uri("captions"), options)
    if buckets is None or captions is None:
        raise RuntimeError("materialize `buckets` and `captions` before `mds_shards`")
    placed = buckets.to_table(columns=["sample_id", "tier", "bucket_width", "bucket_height"],
                              filter=f"{source_predicate(source)} AND tier IS NOT NULL")
    version, samples = scan_partition(storage.lance_uri("samples"), source_predicate(source),
                                      ["sample_id", "content_id", "source_key"], options)
    texts = captions.to_table(columns=["content_id", "caption"],
                              filter=f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error = ''")
    text_of = dict(zip(texts["content_id"].to_pylist(), texts["caption"].to_pylist()))
    sample_of = {r["sample_id"]: r for r in samples.to_pylist()}
    planned, missing = [], []
    for row in placed.to_pylist():
        sample = sample_of.get(row["sample_id"])
        if sample is None:
            continue  # buckets older than samples: the freshness of `buckets` is Dagster's concern
        caption = text_of.get(sample["content_id"])
        if caption is None:
            missing.append(reject_row(row["sample_id"], source, sample["source_key"], sample["content_id"], "mds_shards",
                                      NO_CAPTION, f"no caption for captioner version {captioner_version}"))
            continue
        planned.append({"sample_id": row["sample_id"], "address": sample["_rowaddr"], "caption": caption,
                        "bucket": (row["tier"], row["bucket_width"], row["bucket_height"])})
    planned.sort(key=lambda p: (p["bucket"], p["sample_id"]))
    return planned, missing, {"samples": version, "buckets": buckets.version, "captions": captions.version}


def build_mds(
    source: str, storage: Storage, captioner_version: str, max_tier: int = TIERS[-1],
    max_pixels: int = DEFAULT_MAX_PIXELS, progress: Progress | None = None,
) -> MdsReport:
    start = time.monotonic()
    options = storage.lance_storage_options()
    planned, rejects, versions = plan_rows(source, storage, captioner_version)
    base = {"uri": storage.lance_uri("samples"), "version": versions["samples"], "lance_options": options, "max_tier": max_tier,
            "max_pixels": max_pixels}
    tasks = [{**base, "addresses": [p["address"] for p in part], "plans": [{"caption": p["caption"], "bucket": list(p["bucket"])} for p in part]}
             for part in chunk(planned, ROWS_PER_TASK)]
    content_of: dict[str, tuple[str, int]] = {}

    def rows() -> Iterator[dict[str, Any]]:
        for table in map_tasks(tasks, render_rows, ordered=True, progress=progress):
            for row in table.to_pylist():
                if row["reason"]:
                    rejects.append(reject_row(row["sample_id"], source, row["source_key"], row["content_id"],
                                              "mds_shards", row["reason"], row["message"]))
                    continue
                content_of[row["sample_id"]] = (row["content_id"], row["tier"])
                yield row
                if len(content_of) == len(planned) // 2:
                    pause_point("mds_shards:writing")  # half the rows staged, nothing published

    streams = write_source_streams(rows(), storage.root, source, storage.storage_options, grouped=True)
    index = [{"sample_id": sid, "source": source, "content_id": content_of[sid][0], "tier": s.tier,
              "bucket": f"{s.width}x{s.height}", "index": i, "image_sha256": sha, "captioner_version": captioner_version}
             for s in streams for i, (sid, sha) in enumerate(zip(s.sample_ids, s.image_sha256))]
    version = write_partition(storage, "mds_index", source_predicate(source), pa.Table.from_pylist(index, schema=schemas.MDS_INDEX))
    refused = pa.Table.from_pylist(rejects, schema=schemas.REJECTS).sort_by("sample_id")
    write_partition(storage, "rejects", rejects_predicate(source, "mds_shards"), refused)
    return MdsReport(source, len(index), streams, dict(Counter(refused["reason"].to_pylist())),
                     time.monotonic() - start, versions, version)

