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


def taken_down_keys(storage: Storage, source: str) -> frozenset[str]:
    """The source keys (`<source>/` removed) of `taken_down_ids`: what an ingest unit refuses."""
    prefix = f"{source}/"
    return frozenset(i[len(prefix):] for i in taken_down_ids(storage, source).to_pylist() if i.startswith(prefix))
