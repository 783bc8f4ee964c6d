"""An opt-out file of sample ids (`<source>/<source_key>`, one a line, possibly millions): streamed,
split by source and by a hash of the id into parquet parts, then matched against the corpus a
few hash buckets at a time.

Nothing holds the whole file: reading keeps at most `batch_ids` ids in memory before they are
written out; matching takes whole hash buckets of one source, about `batch_ids` ids at a time (a
hash set in Arrow, ~50 bytes an id, never a Python set), so a repeated id falls in one pass and
is counted once, and scans the source's `samples` ids and its streams' chunk records (one chunk
at a time) against it: one pass per `batch_ids` ids of a source. What grows is what must: per
affected stream, the positions to skip or drop (what its skip-list holds anyway), the matched ids
(for the deletes) and at most `examples` unknown ids for the report.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.shards.mds.rewrite import stream_chunks
from prx_core.shards.mds.streams import StreamKey, list_streams, read_chunk_record, stream_key_of
from prx_core.sources.catalog import NAME_PATTERN, validate_source_name
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage, join_uri

BATCH_IDS = 1_000_000  # ids held at once while reading the file
BUCKETS = 64  # hash buckets per source: what one matching pass holds is 1/BUCKETS of its ids
EXAMPLES = 20  # unknown or malformed ids listed in the report


@dataclass
class Spool:
    """The file's ids split by source and hash bucket into parquet parts under `folder`."""

    folder: str
    buckets: int = BUCKETS
    read: int = 0  # non-empty lines
    digest: str = ""  # SHA-256 of the file, for the audit record
    malformed: int = 0
    examples: list[str] = field(default_factory=list)  # malformed lines
    parts: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # source -> bucket -> part files

    def ids(self, source: str, batch_ids: int = BATCH_IDS) -> Iterator[pa.Array]:
        """The source's ids as unique arrays of whole hash buckets, about `batch_ids` each: one
        pass over the source per array, so a file of up to `batch_ids` ids of a source costs one."""
        group: list[pa.Array] = []
        held = 0
        for bucket in sorted(self.parts.get(source, {})):
            group += [pq.read_table(p)["sample_id"].combine_chunks() for p in self.parts[source][bucket]]
            held += sum(len(a) for a in group[-len(self.parts[source][bucket]):])
            if held >= batch_ids:
                yield pc.unique(pa.concat_arrays(group))
                group, held = [], 0
        if group:
            yield pc.unique(pa.concat_arrays(group))

    def count(self, source: str) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for paths in self.parts.get(source, {}).values() for p in paths)


def spool_ids(path: str, folder: str, batch_ids: int = BATCH_IDS, examples: int = EXAMPLES,
              buckets: int = BUCKETS) -> Spool:
    """Stream the file into per-source, per-bucket parts under `folder` (local): one line, one id."""
    spool = Spool(folder, buckets)
    digest = hashlib.sha256()
    pending: dict[tuple[str, int], list[str]] = {}
    held = 0
    with open(path, "rb") as handle:
        for raw in handle:
            digest.update(raw)
            line = raw.decode("utf-8", "replace").strip()
            if not line or line.startswith("#"):
                continue
            spool.read += 1
            source, _, key = line.partition("/")
            if not key or not NAME_PATTERN.fullmatch(source):
                spool.malformed += 1
                if len(spool.examples) < examples:
                    spool.examples.append(line[:200])
                continue
            pending.setdefault((source, zlib.crc32(line.encode()) % buckets), []).append(line)
            held += 1
            if held >= batch_ids:
                _flush(spool, pending)
                held = 0
    _flush(spool, pending)
    spool.digest = digest.hexdigest()
    return spool


def _flush(spool: Spool, pending: dict[tuple[str, int], list[str]]) -> None:
    for (source, bucket), ids in pending.items():
        parts = spool.parts.setdefault(source, {}).setdefault(bucket, [])
        os.makedirs(os.path.join(spool.folder, source), exist_ok=True)
        path = os.path.join(spool.folder, source, f"b{bucket:04d}-{len(parts):05d}.parquet")
        pq.write_table(pa.table({"sample_id": pa.array(ids, pa.string())}), path)
        parts.append(path)
    pending.clear()


@dataclass
class StreamHits:
    """One stream's matched positions and their ids, in the order found (sorted on use)."""

    key: StreamKey
    positions: list[np.ndarray] = field(default_factory=list)
    ids: list[pa.Array] = field(default_factory=list)

    def sorted(self) -> tuple[np.ndarray, pa.Array]:
        positions = np.concatenate(self.positions) if self.positions else np.empty(0, np.int64)
        ids = pa.concat_arrays(self.ids) if self.ids else pa.array([], pa.string())
        positions, first = np.unique(positions, return_index=True)
        return positions.astype(np.int64), ids.take(pa.array(first))


@dataclass
class SourceMatch:
    """What the file's ids of one source matched."""

    source: str
    requested: int = 0
    in_samples: int = 0
    unknown: int = 0
    examples: list[str] = field(default_factory=list)
    streams: dict[StreamKey, StreamHits] = field(default_factory=dict)

    @property
    def in_streams(self) -> int:
        return sum(sum(len(p) for p in h.positions) for h in self.streams.values())


def match_source(storage: Storage, spool: Spool, source: str, batch_ids: int = BATCH_IDS,
                 examples: int = EXAMPLES) -> tuple[SourceMatch, list[pa.Array]]:
    """Match the source's ids against its `samples` rows and its published streams, bucket by
    pass; returns the match and the arrays of ids found in `samples` (one per pass), for deletes."""
    validate_source_name(source)
    match, found_batches = SourceMatch(source), []
    streams = [(stream_key_of(uri), uri) for uri in list_streams(storage.root, source, storage.storage_options, members=True)]
    for ids in spool.ids(source, batch_ids):
        match.requested += len(ids)
        found = _in_samples(storage, source, ids)
        match.in_samples += len(found)
        missing = pc.filter(ids, pc.invert(pc.is_in(ids, value_set=found)))
        match.unknown += len(missing)
        match.examples += missing.slice(0, max(0, examples - len(match.examples))).to_pylist()
        if len(found):
            found_batches.append(found)
            for key, uri in streams:
                _match_stream(storage, uri, key, found, match)
    return match, found_batches


def _in_samples(storage: Storage, source: str, ids: pa.Array) -> pa.Array:
    """The ids of `ids` the source's `samples` partition holds: one scan of its id column."""
    ds = lance_io.open_table(storage.lance_uri("samples"), storage.lance_storage_options())
    if ds is None:
        return pa.array([], pa.string())
    hits = []
    for batch in ds.to_batches(columns=["sample_id"], filter=source_predicate(source)):
        column = batch.column(0)
        hits.append(pc.filter(column, pc.is_in(column, value_set=ids)))
    return pa.concat_arrays(hits) if hits else pa.array([], pa.string())


def _match_stream(storage: Storage, uri: str, key: StreamKey, ids: pa.Array, match: SourceMatch) -> None:
    """Positions of `ids` in one stream, read chunk record by chunk record (its stream order)."""
    offset = 0
    for name, count in stream_chunks(storage, uri)[1]:
        record = read_chunk_record(join_uri(uri, name), storage.storage_options)
        stored = record.filter(pc.field("reason").is_null())["sample_id"].combine_chunks()
        mask = pc.is_in(stored, value_set=ids)
        where = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        if len(where):
            hits = match.streams.setdefault(key, StreamHits(key))
            hits.positions.append(where.astype(np.int64) + offset)
            hits.ids.append(stored.take(pa.array(where)))
        offset += count
