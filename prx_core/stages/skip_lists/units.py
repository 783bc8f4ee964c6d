"""The work units of `skip_lists`: per chunk, the skipped positions by reason (its losing
duplicates looked up by sample_id, its labels by caption key, batched IN-list lookups on the
shared tables, and the opt-outs it matches), written to scratch; per stream, its chunks' scratch
concatenated in chunk order into the stream's skip-lists and completion record
(prx_core.shards.skiplists)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute.units import Unit, UnitRun
from prx_core.shards.mds.streams import read_chunk_record
from prx_core.shards.skiplists.files import stream_folder, stream_key, write_stream_lists
from prx_core.store import lance_io
from prx_core.store.lookups import lookup_keys
from prx_core.store.storage import Storage, join_uri

SCRATCH_SCHEMA = pa.schema([("index", pa.int64()), ("sample_id", pa.string()), ("reason", pa.string())])


def skip_chunk_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the skipped positions of one chunk, by reason, written to scratch."""
    storage, params, inputs = run.storage, run.manifest.params, run.manifest.inputs
    options = storage.lance_storage_options()
    record = read_chunk_record(join_uri(unit.spec["stream_uri"], unit.spec["chunk"]), storage.storage_options)
    record = record.filter(pc.field("reason").is_null())
    ids, contents = record["sample_id"].to_pylist(), record["caption_key"].to_pylist()  # labels are keyed by caption
    reasons: list[tuple[str, set[str], list[str]]] = []  # (reason, hits, the column they match)
    if params["duplicates"] and inputs.get("duplicates") is not None:
        losers = lookup_keys(storage.lance_uri("duplicates"), "sample_id", ids, ["sample_id"], "NOT keeper",
                             options, inputs["duplicates"])
        reasons.append(("duplicate", set(losers["sample_id"].to_pylist()), ids))
    if params["labels"] and inputs.get("caption_labels") is not None:
        where = (f"captioner_version = {lance_io.sql_literal(params['captioner_version'])} AND labeler_version = "
                 f"{lance_io.sql_literal(params['labeler_version'])}")
        labels = lookup_keys(storage.lance_uri("caption_labels"), "content_id", contents, ["content_id", "label"],
                             where, options, inputs["caption_labels"])
        for label in params["labels"]:
            hit = labels.filter(pc.field("label") == label)["content_id"].to_pylist()
            reasons.append((label, set(hit), contents))
        if params.get("unlabelled"):
            reasons.append(("unlabelled", set(contents) - set(labels["content_id"].to_pylist()), contents))
    wanted = set(params["opt_out"]) | recorded_opt_outs(storage, inputs.get("opt_out_records") or [], ids)
    if wanted:
        keys = [sid if sid in wanted else sid.split("/", 1)[1] for sid in ids]  # a sample_id or a source_key
        reasons.append(("opt_out", wanted, keys))
    rows: dict[str, list] = {"index": [], "sample_id": [], "reason": []}
    counts: Counter[str] = Counter()
    for reason, hits, column in reasons:
        for position, (sid, value) in enumerate(zip(ids, column)):
            if value in hits:
                rows["index"].append(unit.spec["offset"] + position)
                rows["sample_id"].append(sid)
                rows["reason"].append(reason)
                counts[reason] += 1
    fs = storage.filesystem()
    path = run.scratch_uri("skips", unit.spec["label"].replace("/", "_"), f"{unit.spec['chunk']}.parquet")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as handle:
        pq.write_table(pa.table(rows, schema=SCRATCH_SCHEMA), handle)
    return {"rows": len(ids), "skipped": dict(counts)}


def skip_stream_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: one stream's skip-lists from its chunks' scratch files, in chunk order."""
    storage, spec = run.storage, unit.spec
    fs = storage.filesystem()
    parts = []
    for chunk in spec["chunks"]:
        with fs.open(run.scratch_uri("skips", spec["label"].replace("/", "_"), f"{chunk}.parquet"), "rb") as handle:
            parts.append(pq.read_table(handle, pre_buffer=False))
    table = pa.concat_tables(parts) if parts else SCRATCH_SCHEMA.empty_table()
    lists = {}
    for reason in sorted(set(table["reason"].to_pylist())):
        part = table.filter(pc.field("reason") == reason).sort_by("index")
        lists[reason] = (part["index"].to_numpy(), part["sample_id"])
    tier, width, height = spec["stream"]
    header = {"source": run.manifest.partition, "tier": tier, "width": width, "height": height,
              "stream": stream_key(run.manifest.partition, tier, width, height), "stream_size": spec["size"],
              "policy_version": run.manifest.params["policy_version"], "index_digest": spec["digest"]}
    written = write_stream_lists(fs, stream_folder(storage.root, run.manifest.partition, tier, width, height),
                                 header, lists, applied_reasons(run.manifest.params, run.manifest.inputs))
    union = len(np.unique(table["index"].to_numpy())) if table.num_rows else 0
    return {"rows": spec["size"], "skipped": union, "by_reason": {r: len(v[0]) for r, v in lists.items()},
            "files": written}


def applied_reasons(params: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    """The reasons this run checked every sample for (what a stream's completion record lists):
    the policy's, less those whose table does not exist yet (no `duplicates` run, no labels)."""
    reasons = ["duplicate"] if params["duplicates"] and inputs.get("duplicates") is not None else []
    if params["labels"] and inputs.get("caption_labels") is not None:
        reasons += list(params["labels"]) + (["unlabelled"] if params.get("unlabelled") else [])
    return reasons + (["opt_out"] if params["opt_out"] or inputs.get("opt_out_records") else [])


def recorded_opt_outs(storage: Storage, records: list[str], ids: list[str]) -> set[str]:
    """Which of a chunk's ids the recorded opt-outs name, read file by file with the chunk's ids
    as the filter (a source's records may hold millions of ids; a chunk holds thousands)."""
    if not records or not ids:
        return set()
    wanted, fs = pa.array(ids, pa.string()), storage.filesystem()
    hits: set[str] = set()
    for uri in records:
        with fs.open(uri, "rb") as handle:
            column = pq.read_table(handle, columns=["sample_id"])["sample_id"]
        hits.update(column.filter(pc.is_in(column, value_set=wanted)).to_pylist())
    return hits
