"""Stage `mds_shards`: the source's streams, resized to their buckets, JPEG q92, with captions.

Three passes of work units over the pinned `samples` version; the driver holds unit summaries:
1. route: per row range, bucket every sample from its recorded size (the `buckets` function),
   sort by (stream, sample_id) and write the rows to scratch parquet; report per-stream counts
   and a deterministic sample of ids (those whose hash is 0 modulo SAMPLE_EVERY).
2. chunks: each stream is cut at sampled ids into chunks of about `chunk_rows` (the boundaries
   depend on the data only, never on the number of workers); per chunk a worker gathers its
   rows from the route files, sorts them by sample_id, joins their captions, decodes and encodes
   each image once (`process_image`) and writes the chunk folder (prx_core.shards.mds). A chunk
   folder is named after what its bytes depend on, so a rerun over the same content reuses it.
3. index: the driver publishes each stream's index.json (merged from its chunks); per chunk a
   worker writes the `mds_index` rows (position = chunk offset + row) and the chunk's rejects;
   one commit per table.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from prx_core.compute.parallel import Throttle, take_rows
from prx_core.compute.row_units import plan_row_units, read_row_unit
from prx_core.compute.shuffle import hash_values
from prx_core.compute.units import Manifest, Unit, UnitResults, UnitRun, run_units
from prx_core.image.buckets import TIERS, Bucket, assign_buckets
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection
from prx_core.image.imaging import process_image
from prx_core.models.captioning import missing_caption_message
from prx_core.shards.mds import StreamKey, chunk_complete, read_chunk_record, stream_name, stream_uri, write_chunk
from prx_core.shards.publish import StreamReport, publish_source
from prx_core.store import lance_io, schemas
from prx_core.store.locks import exclusive
from prx_core.store.lookups import caption_errors, caption_texts
from prx_core.store.partitions import commit_unit_outputs, source_predicate, unit_outputs, write_rejects
from prx_core.store.storage import Storage, join_uri

ROUTE_ROWS = 1_000_000  # rows per routing unit: sizes and ids, no pixels
CHUNK_ROWS = 50_000  # target rows per MDS chunk: one worker task, one sub-folder of a stream
SAMPLES_PER_CHUNK = 32  # sampled ids per chunk the boundaries are chosen from
TAKE_ROWS = 32  # images read from Lance per request
NO_CAPTION = "no_caption"
BUCKET_MISMATCH = "bucket_mismatch"
CHUNK_FORMAT = "mds-chunk-1"  # bump when what a chunk's bytes depend on changes outside its inputs
ROUTE_SCHEMA = pa.schema([
    ("tier", pa.int32()), ("bucket_width", pa.int32()), ("bucket_height", pa.int32()), ("sample_id", pa.string()),
    ("content_id", pa.string()), ("source_key", pa.string()), ("address", pa.uint64())])


@dataclass
class MdsReport:
    source: str
    written: int
    streams: list[StreamReport]
    rejects: dict[str, int]
    seconds: float
    read_versions: dict[str, int] = field(default_factory=dict)
    mds_index_version: int = 0
    units: dict[str, UnitResults] = field(default_factory=dict)

    @property
    def images_per_second(self) -> float:
        return self.written / max(self.seconds, 1e-9)


def stream_label(key: StreamKey) -> str:
    return stream_name(*key)


def route_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: bucket one row range and write it, sorted by stream and sample_id, to scratch."""
    storage, params = run.storage, run.manifest.params
    rows = read_row_unit(storage.lance_uri("samples"), run.manifest.inputs["samples"], unit.spec,
                         ["sample_id", "content_id", "source_key", "width", "height"],
                         source_predicate(run.manifest.partition), storage.lance_storage_options(),
                         with_row_address=True)
    decisions = assign_buckets(rows["width"].to_numpy(), rows["height"].to_numpy(), params["max_tier"])
    kept = np.array([isinstance(d, Bucket) for d in decisions], bool)
    buckets = [d for d in decisions if isinstance(d, Bucket)]
    rows = rows.filter(pa.array(kept))
    routed = pa.table({
        "tier": pa.array([b.tier for b in buckets], pa.int32()),
        "bucket_width": pa.array([b.width for b in buckets], pa.int32()),
        "bucket_height": pa.array([b.height for b in buckets], pa.int32()),
        "sample_id": rows["sample_id"], "content_id": rows["content_id"], "source_key": rows["source_key"],
        "address": rows["_rowaddr"]}, schema=ROUTE_SCHEMA)
    routed = routed.sort_by([("tier", "ascending"), ("bucket_width", "ascending"), ("bucket_height", "ascending"),
                             ("sample_id", "ascending")])
    fs = storage.filesystem()
    path = run.scratch_uri("route", f"{unit.id}.parquet")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as handle:
        pq.write_table(routed, handle, row_group_size=1 << 14)
    labels = [stream_label((b.tier, b.width, b.height)) for b in buckets]
    every = params["sample_every"]
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
    for label in sorted(counts, key=_label_key):
        ids = sorted(set(sampled.get(label, [])))
        parts = max(1, min(round(counts[label] / chunk_rows), len(ids) + 1))
        bounds = sorted({ids[(i * len(ids)) // parts] for i in range(1, parts)})
        edges = [None, *bounds, None]
        tier, width, height = _label_key(label)
        for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
            spec = {"stream": [tier, width, height], "lo": lo, "hi": hi}
            units.append(Unit(f"chunk-{tier:04d}-{width:05d}x{height:05d}-{i:05d}", counts[label] // len(edges[1:]), spec))
    return units


def _label_key(label: str) -> StreamKey:
    tier, size = label.split("/")
    width, height = size.split("x")
    return int(tier), int(width), int(height)


def chunk_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: write one chunk folder of a stream, or reuse the complete folder of the same
    content (a rerun, a resumed run, another run whose inputs hold the same rows), and report what
    it holds."""
    storage, source = run.storage, run.manifest.partition
    tier, width, height = unit.spec["stream"]
    rows = chunk_rows(unit, run)
    captions = caption_texts(storage, run.manifest.params["captioner_version"], rows["content_id"].to_pylist(),
                             run.manifest.inputs["captions"])
    originals = take_rows(storage.lance_uri("samples"), run.manifest.inputs["samples"], rows["address"].to_pylist(),
                          ["original_caption"], storage.lance_storage_options())["original_caption"].to_pylist()
    name = chunk_name(run, rows, captions, originals)
    folder = join_uri(stream_uri(storage.root, source, tier, width, height), name)
    reused = chunk_complete(folder, storage.storage_options)
    if not reused:
        refused: list[dict] = []
        write_chunk(render(rows, captions, originals, run, refused), folder, storage.storage_options, refused)
    record = read_chunk_record(folder, storage.storage_options)
    stored = record.filter(pc.field("reason").is_null())
    return {"rows": stored.num_rows, "rejected": record.num_rows - stored.num_rows, "reused": reused, "name": name,
            "reasons": dict(Counter(record["reason"].drop_null().to_pylist())),
            "outputs": [] if reused else [folder]}  # a reused folder may be live: never an orphan


def chunk_name(run: UnitRun, rows: pa.Table, captions: dict[str, str], originals: list[str | None]) -> str:
    """A name derived from everything the chunk's bytes depend on (the code and its settings, each
    row's id, content and captions): the same content always gets the same folder, other content
    never does, so a published name is never rewritten with other bytes."""
    params = run.manifest.params
    digest = hashlib.sha256(json.dumps([CHUNK_FORMAT, run.manifest.code_version, params["max_tier"], params["max_pixels"],
                                        run.manifest.partition, rows["tier"][0].as_py() if rows.num_rows else None,
                                        rows["bucket_width"][0].as_py() if rows.num_rows else None,
                                        rows["bucket_height"][0].as_py() if rows.num_rows else None]).encode())
    for sid, cid, key, original in zip(rows["sample_id"].to_pylist(), rows["content_id"].to_pylist(),
                                       rows["source_key"].to_pylist(), originals):
        digest.update(json.dumps([sid, cid, key, captions.get(cid), original]).encode())
    return "c-" + digest.hexdigest()[:24]


def chunk_rows(unit: Unit, run: UnitRun) -> pa.Table:
    """The chunk's routed rows, gathered from every route file (row groups pruned by their
    statistics: route files are sorted the same way), sorted by sample_id."""
    tier, width, height = unit.spec["stream"]
    fs = run.storage.filesystem()
    folder = run.scratch_uri("route")
    paths = sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".parquet"))
    condition = (pc.field("tier") == tier) & (pc.field("bucket_width") == width) & (pc.field("bucket_height") == height)
    if unit.spec["lo"] is not None:
        condition &= pc.field("sample_id") >= unit.spec["lo"]
    if unit.spec["hi"] is not None:
        condition &= pc.field("sample_id") < unit.spec["hi"]
    dataset = pads.dataset(paths, schema=ROUTE_SCHEMA, format="parquet", filesystem=fs)
    return dataset.to_table(filter=condition).sort_by("sample_id")


def render(rows: pa.Table, captions: dict[str, str], originals: list[str | None], run: UnitRun,
           refused: list[dict]) -> Iterator[dict[str, Any]]:
    """The chunk's MDS rows in order, its captions joined, each image decoded and encoded once;
    what cannot be stored goes to `refused` with a reason (an uncaptioned one with its stored failure)."""
    storage, params, source = run.storage, run.manifest.params, run.manifest.partition
    uncaptioned = [c for c in rows["content_id"].to_pylist() if c not in captions]
    why = caption_errors(storage, params["captioner_version"], uncaptioned, run.manifest.inputs["captions"]).get
    for start in range(0, rows.num_rows, TAKE_ROWS):
        part = rows.slice(start, TAKE_ROWS).to_pylist()
        images = take_rows(storage.lance_uri("samples"), run.manifest.inputs["samples"], [r["address"] for r in part],
                           ["image"], storage.lance_storage_options())["image"].to_pylist()
        for row, image, original in zip(part, images, originals[start:start + TAKE_ROWS]):
            base = {"sample_id": row["sample_id"], "content_id": row["content_id"], "source_key": row["source_key"]}
            caption = captions.get(row["content_id"])
            if caption is None:
                refused.append({**base, "reason": NO_CAPTION, "message": missing_caption_message(
                    params["captioner_version"], why(row["content_id"]))})
                continue
            result = process_image(image, max_pixels=params["max_pixels"], max_tier=params["max_tier"])
            if isinstance(result, Rejection):
                refused.append({**base, "reason": result.reason, "message": result.message})
                continue
            got = (result.bucket.tier, result.bucket.width, result.bucket.height)
            if got != (row["tier"], row["bucket_width"], row["bucket_height"]):
                refused.append({**base, "reason": BUCKET_MISMATCH, "message": f"{result.bucket} != routed {got}"})
                continue
            yield {**base, "source": source, "jpeg": result.jpeg, "caption": caption,
                   "original_caption": original or "", "width": result.bucket.width,
                   "height": result.bucket.height, "original_width": result.original_size[0],
                   "original_height": result.original_size[1]}


def index_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the chunk's `mds_index` rows (global positions from its offset) and rejects, as
    uncommitted fragments."""
    storage, source = run.storage, run.manifest.partition
    tier, width, height = unit.spec["stream"]
    folder = join_uri(stream_uri(storage.root, source, tier, width, height), unit.spec["name"])
    record = read_chunk_record(folder, storage.storage_options)
    stored = record.filter(pc.field("reason").is_null())
    refused = record.filter(pc.field("reason").is_valid())
    n = stored.num_rows
    index = pa.table({
        "sample_id": stored["sample_id"], "source": pa.array([source] * n, pa.string()),
        "content_id": stored["content_id"], "tier": pa.array([tier] * n, pa.int32()),
        "bucket": pa.array([f"{width}x{height}"] * n, pa.string()),
        "index": pa.array(np.arange(unit.spec["offset"], unit.spec["offset"] + n), pa.int64()),
        "image_sha256": stored["image_sha256"],
        "captioner_version": pa.array([run.manifest.params["captioner_version"]] * n, pa.string())},
        schema=schemas.MDS_INDEX)
    rejects = pa.table({
        "sample_id": refused["sample_id"], "source": pa.array([source] * refused.num_rows, pa.string()),
        "source_key": refused["source_key"], "content_id": refused["content_id"],
        "stage": pa.array(["mds_shards"] * refused.num_rows, pa.string()), "reason": refused["reason"],
        "message": refused["message"], "width": pa.nulls(refused.num_rows, pa.int32()),
        "height": pa.nulls(refused.num_rows, pa.int32())}, schema=schemas.REJECTS)
    uri = storage.lance_uri("mds_index")
    written = lance_io.write_fragments(uri, index, schemas.MDS_INDEX, storage.lance_storage_options()) if n else []
    refused_fragments = write_rejects(storage, rejects)
    return {"rows": n, **unit_outputs(storage, "mds_index", written, refused_fragments)}


@exclusive("mds_shards")
def build_mds(
    source: str, storage: Storage, captioner_version: str, max_tier: int = TIERS[-1],
    max_pixels: int = DEFAULT_MAX_PIXELS, progress: Throttle | None = None,
    route_rows: int = ROUTE_ROWS, chunk_rows: int = CHUNK_ROWS,
) -> MdsReport:
    start = time.monotonic()
    options = storage.lance_storage_options()
    if not lance_io.table_exists(storage.lance_uri("captions"), options):
        raise RuntimeError("materialize `buckets` and `captions` before `mds_shards`")
    version, route = plan_row_units(storage.lance_uri("samples"), source_predicate(source), route_rows, options)
    captions_version = lance_io.table_version(storage.lance_uri("captions"), options)
    params = {"captioner_version": captioner_version, "max_tier": max_tier, "max_pixels": max_pixels,
              "route_rows": route_rows, "chunk_rows": chunk_rows,
              "sample_every": max(1, chunk_rows // SAMPLES_PER_CHUNK)}
    manifest = Manifest("mds_shards", source, {"samples": version, "captions": captions_version}, "2", params)
    run = UnitRun.open(storage, manifest)
    routed = run_units(run, [Unit(f"route-{u.id}", u.rows, u.spec) for u in route], route_unit,
                       progress=_phase(progress, "route"), phase="route")
    chunks = plan_chunks(routed, chunk_rows)
    written = run_units(run, chunks, chunk_unit, progress=progress, phase="chunks")
    streams = publish_source(storage.root, source, [(tuple(c.spec["stream"]), s["name"], s["rows"], s["rejected"])
                                                    for c, s in zip(chunks, written.summaries)], storage.storage_options)
    offsets = _offsets(chunks, written)
    indexed = run_units(run, [Unit(f"index-{c.id}", c.rows, {**c.spec, "offset": offsets[c.id], "name": s["name"]})
                              for c, s in zip(chunks, written.summaries)],
                        index_unit, progress=_phase(progress, "index"), phase="index")
    index_version, _ = commit_unit_outputs(storage, "mds_index", source, "mds_shards", indexed.summaries)
    run.finish()
    return MdsReport(source, written.total("rows"), streams, written.counts("reasons"), time.monotonic() - start,
                     {"samples": version, "captions": captions_version}, index_version,
                     {"route": routed, "chunks": written, "index": indexed})


def _offsets(chunks: list[Unit], written: UnitResults) -> dict[str, int]:
    """Each chunk's first position in its stream: the rows stored by the chunks before it."""
    offsets, running = {}, Counter()
    for chunk, summary in zip(chunks, written.summaries):
        key = tuple(chunk.spec["stream"])
        offsets[chunk.id] = running[key]
        running[key] += summary["rows"]
    return offsets


def _phase(progress: Throttle | None, name: str) -> Throttle | None:
    return None if progress is None else Throttle(progress.report, f"{progress.label} {name}", progress.seconds,
                                                   progress.unit)
