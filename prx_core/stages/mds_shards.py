"""Stage `mds_shards`: the source's streams, resized to their buckets, JPEG q92, with captions.

Three passes of work units over the pinned `samples` version; the driver holds unit summaries:
1. route: per row range, bucket every sample from its recorded size (the `buckets` function),
   sort by (stream, sample_id) and write the rows to scratch parquet; report per-stream counts
   and a deterministic sample of ids (those whose hash is 0 modulo SAMPLE_EVERY).
2. chunks: each stream is cut at sampled ids into chunks of about `chunk_rows` (the boundaries
   depend on the data only, never on the number of workers); per chunk a worker gathers its
   rows from the route files, sorts them by sample_id, joins their captions, decodes and encodes
   each image once (`process_image`) and writes the chunk folder (`prx_core.stages.mds_chunks`).
   A chunk folder is named after what its bytes depend on, so a rerun over the same content reuses it.
3. index: the driver publishes each stream's index.json (merged from its chunks); per chunk a
   worker writes the `mds_index` rows (position = chunk offset + row) and the chunk's rejects;
   one commit per table.
Declared as `MDS_SHARDS` and run by `run_partition` (lock, attempt, finish), then the streams are
read back after the lock (`prx_core.stages.mds_report`); `build_mds` is the typed call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units, read_row_unit
from prx_core.compute.shuffle import hash_values
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.image.buckets import TIERS, Bucket, assign_buckets
from prx_core.image.decode import DEFAULT_MAX_PIXELS
from prx_core.shards.mds import StreamKey, read_chunk_record, stream_name, stream_uri
from prx_core.shards.publish import StreamReport, publish_source
from prx_core.shards.verify import VerifyReport
from prx_core.shards.retention import named_by_index
from prx_core.stages.mds_chunks import ROUTE_SCHEMA, chunk_unit
from prx_core.stages.mds_report import MdsReport, PublishReport, StreamCount, verify_published
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_unit_outputs, source_predicate, unit_outputs, write_rejects
from prx_core.store.storage import Storage, join_uri
from prx_core.upkeep.indexing import index_table

ROUTE_ROWS = 1_000_000  # rows per routing unit: sizes and ids, no pixels
CHUNK_ROWS = 50_000  # target rows per MDS chunk: one worker task, one sub-folder of a stream
SMALL_STREAM = "small_stream"  # reject reason of a dropped stream's rows (training.small_streams: drop)
SAMPLES_PER_CHUNK = 32  # sampled ids per chunk the boundaries are chosen from


def stream_label(key: StreamKey) -> str:
    return stream_name(*key)


def route_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: bucket one row range and write it, sorted by stream and sample_id, to scratch."""
    storage, params = run.storage, run.manifest.params
    settings = MdsSettings.from_params(params)
    rows = read_row_unit(storage.lance_uri("samples"), run.manifest.inputs["samples"], unit.spec,
                         ["sample_id", "content_id", "source_key", "width", "height"],
                         source_predicate(run.manifest.partition), storage.lance_storage_options(),
                         with_row_address=True)
    decisions = assign_buckets(rows["width"].to_numpy(), rows["height"].to_numpy(), settings.max_tier)
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


def index_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the chunk's `mds_index` rows (global positions from its offset) and rejects, as
    uncommitted fragments."""
    storage, source = run.storage, run.manifest.partition
    tier, width, height = unit.spec["stream"]
    folder = join_uri(stream_uri(storage.root, source, tier, width, height), unit.spec["name"])
    record = read_chunk_record(folder, storage.storage_options)
    stored = record.filter(pc.field("reason").is_null())
    refused = record.filter(pc.field("reason").is_valid())
    if unit.spec.get("dropped"):  # the stream is too small to train on: its rows become rejects
        refused = pa.concat_tables([refused, dropped_rows(stored, unit.spec["dropped"])])
        stored = stored.slice(0, 0)
    n = stored.num_rows
    index = pa.table({
        "sample_id": stored["sample_id"], "source": pa.array([source] * n, pa.string()),
        "content_id": stored["content_id"], "tier": pa.array([tier] * n, pa.int32()),
        "bucket": pa.array([f"{width}x{height}"] * n, pa.string()),
        "index": pa.array(np.arange(unit.spec["offset"], unit.spec["offset"] + n), pa.int64()),
        "image_sha256": stored["image_sha256"],
        "captioner_version": pa.array([MdsSettings.from_params(run.manifest.params).captioner_version] * n,
                                      pa.string())},
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


def dropped_rows(stored: pa.Table, why: str) -> pa.Table:
    """A dropped stream's stored chunk-record rows, refused with reason SMALL_STREAM and `why`."""
    n = stored.num_rows
    stored = stored.set_column(stored.schema.get_field_index("reason"), "reason", pa.array([SMALL_STREAM] * n, pa.string()))
    return stored.set_column(stored.schema.get_field_index("message"), "message", pa.array([why] * n, pa.string()))


def small_streams(chunks: list[Unit], written: UnitResults, minimum: int) -> dict[StreamKey, int]:
    """Streams holding fewer than `minimum` stored samples, with their counts (policies `drop` and
    `merge`); none when `minimum` is 0 (policy `warn`)."""
    if minimum <= 0:
        return {}
    rows: Counter[StreamKey] = Counter()
    for chunk, summary in zip(chunks, written.summaries):
        rows[tuple(chunk.spec["stream"])] += summary["rows"]
    return {key: n for key, n in rows.items() if 0 < n < minimum}


def drop_message(source: str, key: StreamKey, samples: int, minimum: int) -> str:
    return (f"stream {source}/{stream_name(*key)} holds {samples} samples, fewer than one global batch x canonical "
            f"nodes ({minimum}): not published (training.small_streams: drop)")


def pin_inputs(run: StageRun[MdsSettings]) -> dict[str, Any]:
    """The `samples` version the route units read (planned into row ranges), the `captions` (and
    `text_latents`) version the chunks join, and what the source reads of them (`source_reads`);
    refused while there are no captions yet. The versions are `volatile`: every other source's
    ingest and captions move them, so a rerun after a crash resumes its attempt on the versions it
    first pinned (prx_core.compute.units) unless what this source reads changed: its `samples`
    partition (`partition_signature`: the same fragments, so the same rows at the same addresses
    the route files hold) or its own runs of the content-keyed stages (`last_commit`)."""
    storage, options = run.storage, run.storage.lance_storage_options()
    if not lance_io.table_exists(storage.lance_uri("captions"), options):
        raise RuntimeError("materialize `buckets` and `captions` before `mds_shards`")
    version, run.state["route"] = plan_row_units(storage.lance_uri("samples"), source_predicate(run.partition),
                                                 run.settings.route_rows, options)
    run.params["sample_every"] = max(1, run.settings.chunk_rows // SAMPLES_PER_CHUNK)
    inputs: dict[str, Any] = {"samples": version,
                              "captions": lance_io.table_version(storage.lance_uri("captions"), options)}
    if run.settings.latents:  # the samples carry text latents: the version the chunks read them from
        if not lance_io.table_exists(storage.lance_uri("text_latents"), options):
            raise RuntimeError("text_latents is configured but its table does not exist: materialize `text_latents` "
                               "before `mds_shards`")
        inputs["text_latents"] = lance_io.table_version(storage.lance_uri("text_latents"), options)
    return {**inputs, "source_reads": source_reads(storage, run.partition, version, bool(run.settings.latents))}


def source_reads(storage: Storage, source: str, samples: int, latents: bool) -> dict[str, str | None]:
    """What the source's streams read of the shared tables: its `samples` fragments, and its own
    last `captions` (which writes fused latents too) and `text_latents` runs, which made every
    caption and latent of its contents; another source's runs append only other contents (or the
    same content's identical caption), so they leave this as it was."""
    reads = {"samples": lance_io.partition_signature(storage.lance_uri("samples"), source_predicate(source),
                                                     storage.lance_storage_options(), samples),
             "captions": last_commit(storage, "captions", source)}
    if latents:
        reads["text_latents"] = last_commit(storage, "text_latents", source)
    return reads


def write_streams(run: StageRun[MdsSettings]) -> None:
    """Route, write the chunks, publish each stream's index.json (readers see the new streams from
    here: a chunk folder is never rewritten, so the index units may rerun), then index the chunks."""
    routed = run.units("route", [Unit(f"route-{u.id}", u.rows, u.spec) for u in run.state["route"]], route_unit)
    chunks = plan_chunks(routed, run.settings.chunk_rows)
    written = run.units("chunks", chunks, chunk_unit)
    minimum = run.settings.min_stream_samples
    small = small_streams(chunks, written, minimum)
    merged, drop = (small, {}) if run.settings.merge_small else ({}, small)
    run.state["dropped"] = {stream_name(*key): n for key, n in drop.items()}
    run.state["merged"] = {stream_name(*key): n for key, n in merged.items()}
    published = [(tuple(c.spec["stream"]), s["name"], 0 if tuple(c.spec["stream"]) in drop else s["rows"],
                  s["rejected"]) for c, s in zip(chunks, written.summaries)]  # a dropped stream stores nothing
    run.state["streams"] = publish_source(run.storage.root, run.partition, published, run.storage.storage_options,
                                          members=set(merged))
    offsets = _offsets(chunks, written)

    def dropped(key: StreamKey) -> str | None:
        return drop_message(run.partition, key, drop[key], minimum) if key in drop else None

    run.units("index", [Unit(f"index-{c.id}", c.rows, {**c.spec, "offset": offsets[c.id], "name": s["name"],
                                                       "dropped": dropped(tuple(c.spec["stream"]))})
                        for c, s in zip(chunks, written.summaries)], index_unit)


def commit_index(run: StageRun[MdsSettings]) -> dict[str, int]:
    version, _ = commit_unit_outputs(run.storage, "mds_index", run.partition, "mds_shards",
                                     run.results["index"].summaries, index=index_table)
    return {"mds_index": version}


def report_streams(run: StageRun[MdsSettings]) -> MdsReport:
    written = run.results["chunks"]
    rejects = written.counts("reasons")
    if run.state["dropped"]:
        rejects[SMALL_STREAM] = sum(run.state["dropped"].values())
    return MdsReport(run.partition, written.total("rows") - sum(run.state["dropped"].values()), run.state["streams"],
                     rejects, run.seconds, {k: v for k, v in run.inputs.items() if isinstance(v, int)}, run.versions["mds_index"], dict(run.results),
                     dict(run.state["dropped"]), dict(run.state["merged"]))


@dataclass(frozen=True, kw_only=True)
class MdsSettings(Settings):
    """The `mds_shards` settings: whose captions, the tier and pixel caps, the unit sizes, what becomes
    of streams below `min_stream_samples`, and the text latents the chunks carry."""

    captioner_version: str
    max_tier: int = TIERS[-1]
    max_pixels: int = DEFAULT_MAX_PIXELS
    route_rows: int = ROUTE_ROWS
    chunk_rows: int = CHUNK_ROWS
    min_stream_samples: int = 0
    merge_small: bool = False  # below min_stream_samples: merged into `_merged` (True) or dropped
    # {preset, encoder_version, masks, max_tokens} when text_latents is configured
    latents: dict[str, Any] | None = None


MDS_SHARDS: Stage[MdsSettings] = Stage(
    "mds_shards", reads=("samples", "captions", "text_latents", "buckets"),  # buckets: the read-back's counts
    writes=("mds", "mds_index", "rejects"), after=("buckets", "captions", "text_latents"), code_version="2",
    report_type=PublishReport,
    settings=MdsSettings,
    # run in the order route, chunks, index; `chunks` is declared first so that its progress lines
    # carry the plain label (the asset's unit is "chunks"), route's and index's "<label> route|index"
    phases=("chunks", "route", "index"),
    unit_sizes=(UnitSize("route_rows", "Rows per `mds_shards` routing unit (sizes and ids, no pixels)."),
                UnitSize("chunk_rows", "Target rows per MDS chunk: one worker task and one sub-folder of a stream.")),
    pin=pin_inputs, work=write_streams, commit=commit_index, report=report_streams, then=verify_published,
    # moved by every other source's runs: a rerun resumes across them (`source_reads` pins this source's part)
    volatile=("samples", "captions", "text_latents"),
    spare=lambda storage: named_by_index(storage.storage_options),  # a crash after publish: chunks stay live
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(PublishReport, MdsReport, StreamReport, StreamCount, VerifyReport)


def build_mds(source: str, storage: Storage, captioner_version: str, progress: Throttle | None = None,
              **settings: Any) -> MdsReport:
    """`mds_shards` of one source (`run_partition` of MDS_SHARDS, its read-back included): settings
    max_tier, max_pixels, route_rows, chunk_rows, min_stream_samples, merge_small, latents. Returns
    the streams written (the whole `PublishReport`: `run_partition(MDS_SHARDS, ...)`)."""
    return run_partition(MDS_SHARDS, storage, source, progress=progress, captioner_version=captioner_version,
                         **settings).mds


def _offsets(chunks: list[Unit], written: UnitResults) -> dict[str, int]:
    """Each chunk's first position in its stream: the rows stored by the chunks before it."""
    offsets, running = {}, Counter()
    for chunk, summary in zip(chunks, written.summaries):
        key = tuple(chunk.spec["stream"])
        offsets[chunk.id] = running[key]
        running[key] += summary["rows"]
    return offsets
