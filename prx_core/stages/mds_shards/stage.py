"""Stage `mds_shards`: the source's streams, resized to their buckets, JPEG q92, with captions.

Three passes of work units over the pinned `samples` version; the driver holds unit summaries:
1. route: per range of content ids (prx_core.compute.key_ranges), bucket every sample from its
   recorded size (the `buckets` function), join its caption (and latent's address) by caption
   key, whose keys the range keeps together in the shared tables' indexes
   (`prx_core.stages.mds_shards.carried`), sort by (stream, sample_id) and write the rows to
   scratch parquet; report per-stream counts and a deterministic sample of ids (those whose hash
   is 0 modulo `sample_every`; `prx_core.stages.mds_shards.route`).
2. chunks: each stream is cut at sampled ids into chunks of about `chunk_rows` (the boundaries
   depend on the data only, never on the number of workers); per chunk a worker gathers its
   rows from the route files, sorts them by sample_id, decodes and encodes each image once
   (`process_image`) and writes the chunk folder (`prx_core.stages.mds_shards.chunks`).
   A chunk folder is named after what its bytes depend on, so a rerun over the same content reuses it.
3. index: the driver publishes each stream's index.json (merged from its chunks); per chunk a
   worker writes the `mds_index` rows (position = chunk offset + row) and the chunk's rejects
   (`prx_core.stages.mds_shards.index`); one commit per table.
Declared as `MDS_SHARDS` and run by `run_partition` (lock, attempt, finish), then the streams are
read back after the lock (`prx_core.stages.mds_shards.report`); `build_mds` is the typed call.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prx_core.compute import wire
from prx_core.compute.key_ranges import plan_partition_ranges
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import Unit, UnitResults
from prx_core.shards.mds.publish import StreamReport, publish_source
from prx_core.shards.mds.retention import named_by_index
from prx_core.shards.mds.streams import StreamKey, stream_name
from prx_core.shards.mds.verify import VerifyReport
from prx_core.stages.mds_shards.chunks import chunk_unit
from prx_core.stages.mds_shards.index import SMALL_STREAM, drop_message, index_unit, small_streams
from prx_core.stages.mds_shards.report import MdsReport, PublishReport, StreamCount, streams_in_place, verify_published
from prx_core.stages.mds_shards.route import SAMPLES_PER_CHUNK, plan_chunks, route_unit
from prx_core.stages.mds_shards.settings import MdsSettings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io
from prx_core.store.partitions import commit_unit_outputs, source_predicate
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

ROUTE_RULE = "content-ranges"  # how route units are cut, in the manifest: attempts of another rule start over


def pin_inputs(run: StageRun[MdsSettings]) -> dict[str, Any]:
    """The `samples` version the route units read (planned into ranges of content ids), the
    `captions` (and `text_latents`) version they join, and what the source reads of them (`source_reads`);
    refused while there are no captions yet. The versions are `volatile`: every other source's
    ingest and captions move them, so a rerun after a crash resumes its attempt on the versions it
    first pinned (prx_core.compute.units) unless what this source reads changed: its `samples`
    partition (`partition_signature`: the same fragments, so the same rows at the same addresses
    the route files hold) or its own runs of the content-keyed stages (`last_commit`)."""
    storage, options = run.storage, run.storage.lance_storage_options()
    if not lance_io.table_exists(storage.lance_uri("captions"), options):
        raise RuntimeError("materialize `buckets` and `captions` before `mds_shards`")
    version, run.state["route"] = plan_partition_ranges(storage.lance_uri("samples"), "content_id",
                                                       source_predicate(run.partition), run.settings.route_rows, options)
    run.params["sample_every"] = max(1, run.settings.chunk_rows // SAMPLES_PER_CHUNK)
    # route units own ranges of content ids and carry the captions (before: row ranges, and every
    # chunk looked its captions up); an attempt of the earlier rule (other route files) is not resumed
    run.params["route"] = ROUTE_RULE
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


MDS_SHARDS: Stage[MdsSettings] = Stage(
    "mds_shards", reads=("samples", "captions", "text_latents", "buckets"),  # buckets: the read-back's counts
    writes=("mds", "mds_index", "rejects"), after=("buckets", "captions", "text_latents"), code_version="2",
    report_type=PublishReport,
    settings=MdsSettings,
    # run in the order route, chunks, index; `chunks` is declared first so that its progress lines
    # carry the plain label (the asset's unit is "chunks"), route's and index's "<label> route|index"
    phases=("chunks", "route", "index"),
    unit_sizes=(UnitSize("route_rows", "Samples per `mds_shards` routing unit, a range of content ids (sizes, "
                                       "ids and captions, no pixels)."),
                UnitSize("chunk_rows", "Target rows per MDS chunk: one worker task and one sub-folder of a stream.")),
    pin=pin_inputs, work=write_streams, commit=commit_index, report=report_streams, then=verify_published,
    # moved by every other source's runs: a rerun resumes across them (`source_reads` pins this source's part)
    volatile=("samples", "captions", "text_latents"),
    spare=lambda storage: named_by_index(storage.storage_options),  # a crash after publish: chunks stay live
    # a rerun over the same reads runs nothing while the streams it read back are the ones published
    reusable=lambda report: report.verified.ok, present=streams_in_place,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(PublishReport, MdsReport, StreamReport, StreamCount, VerifyReport)
wire.register_moved_from("prx_core.stages.mds_report", PublishReport, MdsReport, StreamCount)  # before the package
wire.register_moved_from("prx_core.shards.publish", StreamReport)  # before shards/mds/ was a package
wire.register_moved_from("prx_core.shards.verify", VerifyReport)


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
