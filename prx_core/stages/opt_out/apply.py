"""Opting samples out at scale: a file of sample ids becomes `opt_out` skip-list entries of the
streams that hold them (the loader skips them at once), or, for a takedown (`delete_bytes`), the
rows leave `samples` (and the per-source tables keyed by sample_id) and the streams that held
them are republished without them (`prx_core.shards.mds.rewrite`).

Skip-lists are only extended, never recomputed here: a stream whose completion record is not
for its current index is refused (materialize `skip_lists` first), so a fresh record never
blesses stale lists. Deleted Lance rows keep their bytes in data files until compaction rewrites
them and the old versions are cleaned; superseded MDS chunks until pruned. `purge` does both now
for what this run touched (see `purge_source`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.shards.manifest_publish import publish_source_manifest
from prx_core.shards.mds.rewrite import (
    StreamRewrite,
    current_record,
    read_stream_lists,
    rewrite_stream,
)
from prx_core.shards.mds.streams import StreamKey, read_stream_index, stream_uri
from prx_core.shards.skiplists.files import stream_folder, stream_key, write_stream_lists
from prx_core.stages.opt_out.ids import BATCH_IDS, BUCKETS, EXAMPLES, SourceMatch, match_source, spool_ids
from prx_core.stages.opt_out.purge import PurgeReport, purge_source
from prx_core.stages.opt_out.takedowns import contents_of, find_copies, record_contents, record_takedowns
from prx_core.store import fencing, lance_io
from prx_core.store.locks import partition_locks
from prx_core.store.names import validate_source_name
from prx_core.store.storage import Storage, put_atomic

# every asset that writes a source's rows or pins their versions: a purge holds all their locks
PURGE_LOCKS = ("raw_source", "samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings",
               "text_latents", "mds_shards", "skip_lists", "explorer")
REASON = "opt_out"  # the skip policy's own reason (SkipPolicy.opt_out), so audits see one kind
SKIP_LOCKS = ("mds_shards", "skip_lists")
# per-source tables keyed by sample_id, and the asset whose lock guards each
DELETE_TABLES = {"samples": "samples", "buckets": "buckets", "phashes": "phashes",
                 "source_embeddings": "caption_embeddings", "explorer": "explorer"}


@dataclass
class OptOutReport:
    read: int = 0
    malformed: int = 0
    matched: int = 0  # ids found in `samples`
    in_streams: int = 0  # of those, stored in a published stream
    unknown: int = 0  # well-formed ids no sample has (or of a source not in the catalog)
    examples: list[str] = field(default_factory=list)  # unknown and malformed ids, at most `examples`
    deleted_rows: dict[str, int] = field(default_factory=dict)  # table -> rows deleted
    streams: list[str] = field(default_factory=list)  # streams whose skip-lists or index were republished
    rewrites: list[StreamRewrite] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)  # other samples of the same picture -> why
    purge: PurgeReport = field(default_factory=PurgeReport)
    record: str = ""  # the audit record under _state/opt_out/


def add_opt_outs(storage: Storage, source: str, key: StreamKey, positions: np.ndarray, ids: pa.Array) -> str:
    """Merge positions into the stream's `opt_out` list and write its lists with a record for
    its current index (refused if the record it has is not for that index)."""
    uri = stream_uri(storage.root, source, *key)
    record = current_record(storage, source, key, uri)
    lists = read_stream_lists(storage, source, key)
    old_positions, old_ids = lists.get(REASON, (np.empty(0, np.int64), pa.array([], pa.string())))
    merged = np.concatenate([old_positions, positions])
    every = pa.concat_arrays([old_ids.cast(pa.string()), ids.cast(pa.string())])
    merged, first = np.unique(merged, return_index=True)
    lists[REASON] = (merged.astype(np.int64), every.take(pa.array(first)))
    fs = storage.filesystem()
    data = read_stream_index(fs, uri)  # a merged member's member.json
    header = {"source": source, "tier": key[0], "width": key[1], "height": key[2], "stream": stream_key(source, *key),
              "stream_size": int(record["stream_size"]), "policy_version": record["policy_version"],
              "index_digest": hashlib.sha256(data).hexdigest()}
    applied = [*(record.get("reasons_applied") or []), REASON]
    write_stream_lists(fs, stream_folder(storage.root, source, *key), header, lists, applied)
    return header["stream"]


def delete_rows(storage: Storage, table: str, ids: pa.Array) -> int:
    """Delete the rows of these sample ids from one table, in one commit (a hash join, no IN-list)."""
    ds = lance_io.open_table(storage.lance_uri(table), storage.lance_storage_options())
    if ds is None or not len(ids):
        return 0
    fencing.ensure_held()  # a writer that lost its partition lock never commits
    result = ds.merge_insert("sample_id").when_matched_delete().execute(pa.table({"sample_id": ids}))
    return int(result.get("num_deleted_rows", 0))


def apply_source(storage: Storage, match: SourceMatch, found: list[pa.Array], delete_bytes: bool,
                 report: OptOutReport) -> None:
    """Apply one source's matches under its partition locks."""
    source = match.source
    assets = [*SKIP_LOCKS, *DELETE_TABLES.values()] if delete_bytes else list(SKIP_LOCKS)
    with partition_locks(storage, source, assets, f"prx-corpus opt-out ({'delete-bytes' if delete_bytes else 'skip'})"):
        for key in sorted(match.streams):
            positions, ids = match.streams[key].sorted()
            if not delete_bytes:
                report.streams.append(add_opt_outs(storage, source, key, positions, ids))
                continue
            rewrite = rewrite_stream(storage, source, key, positions)
            report.rewrites.append(rewrite)
            report.streams.append(rewrite.stream)
        if match.streams:
            publish_source_manifest(storage.root, source, storage.storage_options)
        if delete_bytes:
            for table in DELETE_TABLES:
                deleted = sum(delete_rows(storage, table, ids) for ids in found)
                report.deleted_rows[table] = report.deleted_rows.get(table, 0) + deleted


def purge_recorded(storage: Storage, sources: Sequence[str], discard: bool, report: OptOutReport) -> None:
    """Purge what the recorded takedowns of `sources` deleted (`prx_core.stages.opt_out.purge`),
    under each source's locks of every asset that writes or pins its rows."""
    for source in sources:
        with partition_locks(storage, source, PURGE_LOCKS, "prx-corpus opt-out (purge)"):
            purge_source(storage, source, discard, list(PURGE_LOCKS), report.purge)


def opt_out(storage: Storage, ids_path: str, sources: Sequence[str], delete_bytes: bool = False,
            purge: bool = False, batch_ids: int = BATCH_IDS, examples: int = EXAMPLES,
            buckets: int = BUCKETS, discard_attempts: bool = False, with_copies: bool = False) -> OptOutReport:
    """Read the ids file, match it source by source and apply it. What was asked and done is
    recorded under `<root>/_state/opt_out/`: `<run>.json`, and per source `<source>/<run>.ids.parquet`
    holding the matched ids (audits, and what a later `skip_lists` must keep out); a takedown
    (`delete_bytes`) also records every id it names under `_state/takedowns/` (what ingest refuses)."""
    if (purge or with_copies or discard_attempts) and not delete_bytes:
        raise ValueError("purge, copies and attempts are a takedown's: they need delete_bytes")
    report = OptOutReport()
    work = tempfile.mkdtemp(prefix="prx-opt-out-")
    try:
        spool = spool_ids(ids_path, work, batch_ids, examples, buckets)
        if delete_bytes:  # other samples holding the same picture: listed, or taken down too
            asked = [i for s in sorted(spool.parts) if s in sources for a in spool.ids(s, batch_ids) for i in a.to_pylist()]
            report.copies = find_copies(storage, asked)
            if with_copies and report.copies:
                spool = spool_ids(extended(ids_path, report.copies, sources, work), os.path.join(work, "all"),
                                  batch_ids, examples, buckets)
        run = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{spool.digest[:16]}"
        report.read, report.malformed, report.examples = spool.read, spool.malformed, list(spool.examples)
        per_source = {}
        for source in sorted(spool.parts):
            if source not in sources:  # not a catalog source: every id of it is unknown
                count = spool.count(source)
                report.unknown += count
                report.examples += [f"{source}/... ({count} ids: not a source of the catalog)"]
                continue
            if delete_bytes:  # before anything changes: no later ingest brings these ids back
                record_takedowns(storage, source, run, spool.ids(source, batch_ids))
            match, found = match_source(storage, spool, source, batch_ids, examples)
            report.matched += match.in_samples
            report.in_streams += match.in_streams
            report.unknown += match.unknown
            report.examples += match.examples[: max(0, examples - len(report.examples))]
            if match.in_samples:
                write_matched(storage, source, run, found)
                if delete_bytes:  # before the rows go: what a purge, now or later, removes by content
                    record_contents(storage, source, run, contents_of(storage, pa.concat_arrays(found).to_pylist()))
                apply_source(storage, match, found, delete_bytes, report)
            per_source[source] = {"requested": match.requested, "matched": match.in_samples,
                                  "in_streams": match.in_streams, "unknown": match.unknown}
        if purge:
            purge_recorded(storage, [s for s in sorted(spool.parts) if s in sources], discard_attempts, report)
        report.record = write_audit(storage, run, spool.digest, report, per_source, delete_bytes, purge)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def extended(ids_path: str, copies: dict[str, str], sources: Sequence[str], work: str) -> str:
    """The ids file with the copies of catalog sources appended (a takedown `with_copies`)."""
    path = os.path.join(work, "with-copies.txt")
    with open(ids_path, "rb") as given, open(path, "wb") as out:
        shutil.copyfileobj(given, out)
        out.write(b"\n" + "".join(f"{c}\n" for c in copies if c.split("/", 1)[0] in sources).encode())
    return path


def write_matched(storage: Storage, source: str, run: str, found: list[pa.Array]) -> str:
    """The source's matched ids of this run, one parquet file (written before anything changes)."""
    uri = storage.uri("_state", "opt_out", validate_source_name(source), f"{run}.ids.parquet")
    buffer = io.BytesIO()
    pq.write_table(pa.table({"sample_id": pa.concat_arrays(found)}), buffer)
    if not storage.is_remote:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
    put_atomic(storage.filesystem(), uri, buffer.getvalue())
    return uri


def write_audit(storage: Storage, run: str, digest: str, report: OptOutReport, per_source: dict,
                delete_bytes: bool, purge: bool) -> str:
    """One JSON per run (its time and the file's SHA-256): what it asked, what matched, what changed."""
    uri = storage.uri("_state", "opt_out", f"{run}.json")
    body = {"ids_sha256": digest, "run": run, "delete_bytes": delete_bytes, "purge": purge, "read": report.read,
            "malformed": report.malformed, "matched": report.matched, "in_streams": report.in_streams,
            "unknown": report.unknown, "sources": per_source, "streams": report.streams,
            "deleted_rows": report.deleted_rows}
    if not storage.is_remote:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
    put_atomic(storage.filesystem(), uri, json.dumps(body, sort_keys=True, indent=1).encode())
    return uri
