"""The first pass of `mds_shards`: route units bucket the rows of one range of content ids each,
with what the chunks need of the shared tables (their captions and latents: `carried`), sorted by
(stream, sample_id), into scratch parquet and report per-stream counts and a deterministic sample
of ids (those whose hash is 0 modulo `sample_every`); `plan_chunks` cuts every stream at sampled
ids into the chunk units (prx_core.stages.mds_shards.chunks), so the boundaries depend on the data
only, never on the number of workers or how the route units were cut."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.compute.key_ranges import range_predicate
from prx_core.compute.shuffle import hash_values
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.image.buckets import Bucket, assign_buckets
from prx_core.shards.mds.streams import StreamKey, stream_name
from prx_core.stages.mds_shards.carried import carried_columns
from prx_core.stages.mds_shards.chunks import ROUTE_SCHEMA
from prx_core.stages.mds_shards.settings import MdsSettings
from prx_core.store.lookups import lookup_where
from prx_core.store.partitions import source_predicate

SAMPLES_PER_CHUNK = 32  # sampled ids per chunk the boundaries are chosen from


def stream_label(key: StreamKey) -> str:
    return stream_name(*key)


def route_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: bucket one range of content ids (a range read of the `samples` BTREE), join what
    the chunks need of the shared tables, and write it, sorted by stream and sample_id, to scratch."""
    storage, params, inputs = run.storage, run.manifest.params, run.manifest.inputs
    settings = MdsSettings.from_params(params)
    where = f"{source_predicate(run.manifest.partition)} AND {range_predicate('content_id', unit.spec)}"
    rows = lookup_where(storage.lance_uri("samples"), ["sample_id", "content_id", "source_key", "width", "height",
                                                       "original_caption"],
                        where, storage.lance_storage_options(), inputs["samples"], with_row_address=True)
    decisions = assign_buckets(rows["width"].to_numpy(), rows["height"].to_numpy(), settings.max_tier)
    kept = np.array([isinstance(d, Bucket) for d in decisions], bool)
    buckets = [d for d in decisions if isinstance(d, Bucket)]
    rows = rows.filter(pa.array(kept))
    carried = carried_columns(storage, params, inputs, rows["content_id"].to_pylist(),
                              rows["original_caption"].to_pylist())
    routed = pa.table({
        "tier": pa.array([b.tier for b in buckets], pa.int32()),
        "bucket_width": pa.array([b.width for b in buckets], pa.int32()),
        "bucket_height": pa.array([b.height for b in buckets], pa.int32()),
        "sample_id": rows["sample_id"], "content_id": rows["content_id"], "source_key": rows["source_key"],
        "address": rows["_rowaddr"], **carried}, schema=ROUTE_SCHEMA)
    routed = routed.sort_by([("tier", "ascending"), ("bucket_width", "ascending"), ("bucket_height", "ascending"),
                             ("sample_id", "ascending")])
    fs = storage.filesystem()
    path = run.scratch_uri("route", f"{unit.id}.parquet")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as handle:
        pq.write_table(routed, handle, row_group_size=1 << 14)
    labels = [stream_label((b.tier, b.width, b.height)) for b in buckets]
    every = params["sample_every"]  # not a setting: `pin_inputs` derives it from chunk_rows
    picked = hash_values(rows["sample_id"]) % np.uint64(every) == 0
    sampled: dict[str, list[str]] = {}
    for label, sid, hit in zip(labels, rows["sample_id"].to_pylist(), picked):
        if hit:
            sampled.setdefault(label, []).append(sid)
    return {"rows": routed.num_rows, "streams": dict(Counter(labels)), "sampled": sampled}


def plan_chunks(route: UnitResults, chunk_rows: int) -> list[Unit]:
    """Cut every stream at sampled ids into chunks of about `chunk_rows` rows; chunk i holds the
    sample_ids in [lo, hi). Units sort by (stream, chunk): plan order is stream order."""
    counts: Counter[str] = Counter()
    sampled: dict[str, list[str]] = {}
    for summary in route.summaries:
        counts.update(summary["streams"])
        for label, ids in summary["sampled"].items():
            sampled.setdefault(label, []).extend(ids)
    units = []
    for label in sorted(counts, key=label_key):
        ids = sorted(set(sampled.get(label, [])))
        parts = max(1, min(round(counts[label] / chunk_rows), len(ids) + 1))
        bounds = sorted({ids[(i * len(ids)) // parts] for i in range(1, parts)})
        edges = [None, *bounds, None]
        tier, width, height = label_key(label)
        for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
            spec = {"stream": [tier, width, height], "lo": lo, "hi": hi}
            units.append(Unit(f"chunk-{tier:04d}-{width:05d}x{height:05d}-{i:05d}", counts[label] // len(edges[1:]), spec))
    return units


def label_key(label: str) -> StreamKey:
    tier, size = label.split("/")
    width, height = size.split("x")
    return int(tier), int(width), int(height)
