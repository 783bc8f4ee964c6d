"""Takedowns that stay down: the ids a takedown named, recorded so no re-ingest brings them back.

`prx-corpus opt-out --delete-bytes` deletes a sample's rows and republishes its streams; the
source still holds the image (a URL table's URL, a file in a folder), so any later `samples` run
of the source (a new file, a settings change, a forced re-ingest) would read it again, store it
in Lance and a new MDS chunk, and show it in the explorer. So the takedown records every id it
was asked for (matched or not: an id not ingested yet must not be later either) under
`<root>/_state/takedowns/<source>/<run>.ids.parquet`, before it changes anything, and every
ingest unit refuses those keys before their bytes are fetched or read into a sample: a
`taken_down` reject (`prx_core.sources.ingest`, and the table readers before fetching).

Removing a record file lifts that run's takedowns at the next re-ingest. An ingest unit holds the
source's taken-down keys as a set (~100 bytes an id): fine for the thousands a takedown names.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.store.names import validate_source_name
from prx_core.store.storage import Storage, put_atomic

FOLDER = ("_state", "takedowns")


def record_takedowns(storage: Storage, source: str, run: str, ids: Iterable[pa.Array]) -> str | None:
    """The source's requested sample ids of one takedown run, one parquet file; None when none."""
    arrays = [a.cast(pa.string()) for a in ids if len(a)]
    if not arrays:
        return None
    uri = storage.uri(*FOLDER, validate_source_name(source), f"{run}.ids.parquet")
    buffer = io.BytesIO()
    pq.write_table(pa.table({"sample_id": pa.concat_arrays(arrays)}), buffer)
    if not storage.is_remote:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
    put_atomic(storage.filesystem(), uri, buffer.getvalue())
    return uri


def taken_down_ids(storage: Storage, source: str) -> pa.Array:
    """Every sample id the source's recorded takedowns named (unique; empty when none)."""
    fs = storage.filesystem()
    folder = storage.uri(*FOLDER, validate_source_name(source))
    fs.invalidate_cache()
    if not fs.exists(folder):
        return pa.array([], pa.string())
    arrays = []
    for path in sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".ids.parquet")):
        with fs.open(path, "rb") as handle:
            arrays.append(pq.read_table(handle, columns=["sample_id"])["sample_id"].combine_chunks())
    return pa.concat_arrays(arrays).unique() if arrays else pa.array([], pa.string())


def record_contents(storage: Storage, source: str, run: str, found: pa.Table) -> str | None:
    """The contents the takedown's matched samples held (`sample_id`, `content_id`), recorded before
    their rows go: what a purge, now or later, deletes from the tables keyed by content."""
    if not found.num_rows:
        return None
    uri = storage.uri(*FOLDER, validate_source_name(source), f"{run}.contents.parquet")
    buffer = io.BytesIO()
    pq.write_table(found.select(["sample_id", "content_id"]), buffer)
    if not storage.is_remote:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
    put_atomic(storage.filesystem(), uri, buffer.getvalue())
    return uri


def recorded_contents(storage: Storage, source: str) -> dict[str, str]:
    """sample id -> content of every sample the source's recorded takedowns removed."""
    fs = storage.filesystem()
    folder = storage.uri(*FOLDER, validate_source_name(source))
    fs.invalidate_cache()
    found: dict[str, str] = {}
    for path in sorted(fs.ls(folder, detail=False)) if fs.exists(folder) else []:
        if path.endswith(".contents.parquet"):
            with fs.open(path, "rb") as handle:
                table = pq.read_table(handle, columns=["sample_id", "content_id"])
            found.update((s, c) for s, c in zip(table["sample_id"].to_pylist(), table["content_id"].to_pylist()) if c)
    return found


def taken_down_contents(storage: Storage, source: str) -> list[str]:
    """Every content the source's recorded takedowns removed (unique, sorted)."""
    return sorted(set(recorded_contents(storage, source).values()))


def taken_down_keys(storage: Storage, source: str) -> frozenset[str]:
    """The source keys (`<source>/` removed) of `taken_down_ids`: what an ingest unit refuses."""
    prefix = f"{source}/"
    return frozenset(i[len(prefix):] for i in taken_down_ids(storage, source).to_pylist() if i.startswith(prefix))


def contents_of(storage: Storage, ids: list[str]) -> pa.Table:
    """(sample_id, content_id) of these sample ids in `samples` (a BTREE lookup)."""
    from prx_core.store import lance_io
    from prx_core.store.lookups import lookup_keys

    uri, options = storage.lance_uri("samples"), storage.lance_storage_options()
    if not ids or lance_io.open_table(uri, options) is None:
        return pa.table({"sample_id": pa.array([], pa.string()), "content_id": pa.array([], pa.string())})
    return lookup_keys(uri, "sample_id", ids, ["sample_id", "content_id"], storage_options=options)


def find_copies(storage: Storage, ids: list[str]) -> dict[str, str]:
    """Other samples (any source) holding the same bytes as `ids`, or in one of their duplicate
    groups: sample id -> why (`same content as x`, `duplicate group of x`). A takedown of one id
    leaves these: the CLI lists them, and takes them down too when asked."""
    from prx_core.store import lance_io
    from prx_core.store.lookups import lookup_keys

    options, wanted, copies = storage.lance_storage_options(), set(ids), {}
    held = contents_of(storage, ids)
    by_content = dict(zip(held["content_id"].to_pylist(), held["sample_id"].to_pylist()))
    for source in {i.split("/", 1)[0] for i in ids}:  # ids an earlier takedown already removed from samples
        by_content.update((c, s) for s, c in recorded_contents(storage, source).items() if s in wanted)
    if by_content and lance_io.open_table(storage.lance_uri("buckets"), options) is not None:
        same = lookup_keys(storage.lance_uri("buckets"), "content_id", list(by_content), ["sample_id", "content_id"],
                           storage_options=options)
        for sid, cid in zip(same["sample_id"].to_pylist(), same["content_id"].to_pylist()):
            if sid not in wanted:
                copies.setdefault(sid, f"same content as {by_content[cid]}")
    uri = storage.lance_uri("duplicates")
    if ids and lance_io.open_table(uri, options) is not None:
        groups = lookup_keys(uri, "sample_id", ids, ["sample_id", "group_id"], storage_options=options)
        of = {g: s for s, g in zip(groups["sample_id"].to_pylist(), groups["group_id"].to_pylist()) if g}
        if of:
            members = lookup_keys(uri, "group_id", list(of), ["sample_id", "group_id"], storage_options=options)
            for sid, gid in zip(members["sample_id"].to_pylist(), members["group_id"].to_pylist()):
                if sid not in wanted:
                    copies.setdefault(sid, f"duplicate group of {of[gid]}")
    return dict(sorted(copies.items()))
