"""The last pass of `mds_shards`, after its streams are published: an index unit per chunk writes
the chunk's `mds_index` rows (position = the chunk's offset in its stream + row) and its rejects;
a stream too small to train on (`training.small_streams: drop`) stores nothing, its rows refused
as `small_stream`."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.shards.mds.streams import StreamKey, read_chunk_record, stream_name, stream_uri
from prx_core.stages.mds_shards.settings import MdsSettings
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import unit_outputs, write_rejects
from prx_core.store.storage import join_uri

SMALL_STREAM = "small_stream"  # reject reason of a dropped stream's rows (training.small_streams: drop)


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
