"""How a `duplicates` run recomputes groups on Ray (prx_core.stages.duplicates decides which way;
each way is a plan for its `pin`, a `work` and a `commit` step of the stage):

- all of them: map tasks split every `phashes` row of the pinned version by `phash % buckets`,
  one reduce task per bucket groups its rows and writes fragments; one Overwrite commit;
- those of the changed sources: map tasks hash-split the affected hashes (the changed sources'
  current pHashes, and the group ids their rows had in the previous table) to the reducers, each
  looks the members of its hashes up by `phash` (BTREE), writes the new groups and names the
  previous rows of those groups per `duplicates` fragment; one task per affected fragment
  deletes them; one Update commit. Work follows the changed sources, not the corpus.

Reduces and deletes are work units (phases `reduce`, `delete`): a crashed run resumes from its
recorded units (the map outputs, kept in the object store, are recomputed), and until the
single commit the table is unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance import LanceDataset, LanceOperation

from prx_core.compute.groupby import (
    bucket_count,
    fragment_units,
    gather_keys,
    gather_table,
    hex_ids,
    shuffle,
)
from prx_core.compute.row_units import plan_row_units
from prx_core.compute.units import COMMITTED, Unit, UnitRun
from prx_core.stages.duplicates_state import Layout
from prx_core.stages.stage import StageRun
from prx_core.store import lance_io, schemas
from prx_core.store.lance_io import sql_literal
from prx_core.store.lookups import lookup_literals
from prx_core.store.storage import Storage, put_atomic

LOOKUP_BATCH = 20_000  # keys per IN-list a BTREE answers: 14 us/key at 20k-50k, 29 us at 5k (4M rows)
COLUMNS = ["sample_id", "source", "phash", "pixels", "jpeg_quality", "num_bytes"]
EVERY_ROW = "true"
# an incremental reducer looks its hashes up (~30 us each, members and previous rows): 100k
# hashes take a few seconds. A task's return under Ray's 100 KB inline limit is kept by its
# owner, the driver: a million-row unit's hashes split at most 64 ways stay above it.
KEY_BUCKET_ROWS = 100_000
KEY_BUCKETS = 64


def group_phashes(rows: pa.Table) -> pa.Table:
    """`find_duplicates` as one sort (a reducer's million rows without a Python object per row):
    rows ordered by phash then `keeper_order`, so each group's first row is its keeper."""
    rows = rows.filter(pc.is_valid(rows["phash"]))  # never written: no hash, no group
    if rows.num_rows == 0:
        return schemas.DUPLICATES.empty_table()
    keys = pa.table({"phash": rows["phash"], "pixels": rows["pixels"],
                     "quality": pc.fill_null(rows["jpeg_quality"].cast(pa.int32()), 100),
                     "bytes": pc.fill_null(rows["num_bytes"], 0), "sample_id": rows["sample_id"]})
    order = pc.sort_indices(keys, [("phash", "ascending"), ("pixels", "descending"), ("quality", "descending"),
                                   ("bytes", "descending"), ("sample_id", "ascending")])
    rows = rows.take(order)
    hashes = np.asarray(rows["phash"].to_numpy(), np.uint64)
    starts = np.flatnonzero(np.r_[True, hashes[1:] != hashes[:-1]])
    sizes = np.diff(np.r_[starts, len(hashes)])
    first, size = np.repeat(starts, sizes), np.repeat(sizes, sizes)
    members = np.flatnonzero(size >= 2)
    return pa.table({
        "sample_id": rows["sample_id"].take(members), "source": rows["source"].take(members),
        "group_id": hex_ids(hashes[members]), "group_size": pa.array(size[members].astype(np.int32)),
        "keeper": pa.array(first[members] == members), "keeper_sample_id": rows["sample_id"].take(first[members]),
        "pixels": rows["pixels"].take(members),
    }, schema=schemas.DUPLICATES)


def plan_all(run: StageRun, phashes: LanceDataset) -> dict[str, Any]:
    """A full run's pinned inputs; its map units and bucket count (`run.params`, `run.state`)."""
    units = run.state["map_units"] = fragment_units(phashes, run["unit_rows"])
    run.state["buckets"] = bucket_count(sum(u.rows for u in units), run["rows_per_bucket"])
    run.params.update(mode="full", buckets=run.state["buckets"])
    return {"phashes": phashes.version}


def reduce_all(run: StageRun) -> None:
    """Every group, from every row of the pinned `phashes`: map tasks split them by hash, one
    reduce unit per bucket groups its rows and writes fragments."""
    storage, phashes, units, buckets = run.storage, run.state["phashes"], run.state["map_units"], run.state["buckets"]
    parts = _shuffled(run, buckets, lambda skip: [shuffle(storage.lance_uri("phashes"), phashes.version, units,
                                                          EVERY_ROW, COLUMNS, "phash", buckets,
                                                          storage.lance_storage_options(), skip=skip)])
    run.units("reduce", _reduce_units(parts), _reduce_all)


def commit_all(run: StageRun) -> dict[str, Any]:
    """One Overwrite commit of the reducers' fragments; returns the report's fields."""
    options, uri, table = run.storage.lance_storage_options(), run.storage.lance_uri("duplicates"), run.state["table"]
    reduced, units = run.results["reduce"], run.state["map_units"]
    fragments = lance_io.fragments_from_json(f for s in reduced.summaries for f in s["fragments"])
    _committing(run)
    LanceDataset.commit(uri, LanceOperation.Overwrite(schemas.DUPLICATES, fragments),
                        read_version=table.version if table else None, storage_options=options or None)
    return {"mode": "full", "rows_read": sum(u.rows for u in units), "buckets": run.state["buckets"],
            "map_units": len(units), "rows_written": reduced.total("written"), "units": reduced}


def plan_changed(run: StageRun, phashes: LanceDataset, table: LanceDataset, layout: Layout,
                 changed: list[str]) -> dict[str, Any]:
    """An incremental run's pinned inputs: the changed sources' map units over both tables."""
    predicate = run.state["predicate"] = f"source IN ({', '.join(sql_literal(s) for s in changed)})"
    current = run.state["map_units"] = fragment_units(phashes, run["unit_rows"], layout.matched(changed))
    _, previous = plan_row_units(run.storage.lance_uri("duplicates"), predicate, run["unit_rows"],
                                 run.storage.lance_storage_options(), version=table.version)
    run.state["previous_units"] = previous
    run.state["buckets"] = bucket_count(sum(u.rows for u in current + previous),
                                        min(run["rows_per_bucket"], KEY_BUCKET_ROWS), KEY_BUCKETS)
    run.params.update(mode="incremental", buckets=run.state["buckets"])
    return {"phashes": phashes.version, "duplicates": table.version, "changed": changed}


def reduce_changed(run: StageRun) -> None:
    """The groups of the affected hashes: the changed sources' current ones and the groups they
    had, hash-split to the reducers by map tasks over just those sources' rows of both tables;
    then one unit per affected `duplicates` fragment deletes their previous rows."""
    storage, options, uri = run.storage, run.storage.lance_storage_options(), run.storage.lance_uri("duplicates")
    phashes, table, predicate = run.state["phashes"], run.state["table"], run.state["predicate"]
    buckets = run.state["buckets"]
    current, previous = run.state["map_units"], run.state["previous_units"]
    parts = _shuffled(run, buckets, lambda skip: [
        shuffle(storage.lance_uri("phashes"), phashes.version, current, predicate, ["phash"], "phash", buckets, options,
                keys_only=True, skip=skip),
        shuffle(uri, table.version, previous, predicate, ["group_id"], "group_id", buckets, options,
                keys_only=True, skip=skip)])
    reduced = run.units("reduce", _reduce_units(parts), _reduce_changed)
    targets: dict[int, dict[str, Any]] = {}
    for summary in reduced.summaries:
        for frag_id, delete in summary["deletes"].items():
            target = targets.setdefault(int(frag_id), {"fragment": int(frag_id), "files": [], "rows": 0})
            target["files"].append(delete["path"])
            target["rows"] += delete["rows"]
    run.units("delete", [Unit(f"d{f:07d}", t["rows"], t) for f, t in sorted(targets.items())], _delete_unit)


def commit_changed(run: StageRun) -> dict[str, Any]:
    """One Update commit (none when nothing changed); returns the report's fields."""
    options, uri, table = run.storage.lance_storage_options(), run.storage.lance_uri("duplicates"), run.state["table"]
    reduced, deleted = run.results["reduce"], run.results["delete"]
    removed = [s["fragment"] for s in deleted.summaries if s["updated"] is None]
    updated = lance_io.fragments_from_json(s["updated"] for s in deleted.summaries if s["updated"] is not None)
    new = lance_io.fragments_from_json(f for s in reduced.summaries for f in s["fragments"])
    if removed or updated or new:
        _committing(run)
        op = LanceOperation.Update(removed_fragment_ids=removed, updated_fragments=updated, new_fragments=new)
        LanceDataset.commit(uri, op, read_version=table.version, storage_options=options or None)
    current, previous = run.state["map_units"], run.state["previous_units"]
    return {"mode": "incremental", "buckets": run.state["buckets"], "map_units": len(current) + len(previous),
            "rows_read": sum(u.rows for u in current), "previous_rows_read": sum(u.rows for u in previous),
            "affected_hashes": reduced.total("hashes"), "member_rows": reduced.total("members"),
            "rows_written": reduced.total("written"), "rows_deleted": deleted.total("rows"), "units": reduced}


def _committing(run: StageRun) -> None:
    """Mark the attempt committed BEFORE the commit: if the driver dies right after it, the next
    run (another manifest: its state is stale, so it recomputes all) must not delete the files
    the table now uses as an abandoned attempt's outputs. Dying before it leaks files instead.
    (`run_partition` marks it again when it finishes the attempt.)"""
    assert run.attempt is not None
    put_atomic(run.storage.filesystem(), f"{run.attempt.uri}/{COMMITTED}", b"")


def _shuffled(run: StageRun, buckets: int, maps: Any) -> list[list[Any]]:
    """Per bucket, the refs of its map outputs; the maps run only when some bucket is not yet
    reduced (a resumed run recomputes them, empty for the reduced buckets)."""
    assert run.attempt is not None
    done = {int(u[1:]) for u in run.attempt.completed() if u.startswith("b")}
    if len(done) >= buckets:
        return [[] for _ in range(buckets)]
    outputs = maps(done)
    return [[ref for out in outputs for ref in out[b]] for b in range(buckets)]


def _reduce_units(parts: list[list[Any]]) -> list[Unit]:
    return [Unit(f"b{b:05d}", 0, {"bucket": b, "parts": refs}) for b, refs in enumerate(parts)]


def _reduce_all(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: group one bucket of every phashes row; write its `duplicates` fragments."""
    rows = gather_table(unit.spec["parts"], pa.schema([schemas.PHASHES.field(c) for c in COLUMNS]))
    return {"rows": rows.num_rows, **_write(run.storage, group_phashes(rows))}


def _reduce_changed(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: regroup one bucket of the affected hashes from their members (looked up by
    phash); write the groups, and per `duplicates` fragment the previous group ids to delete
    (a scratch file: the driver holds counts, not ids)."""
    storage, inputs, bucket = run.storage, run.manifest.inputs, unit.spec["bucket"]
    options = storage.lance_storage_options() or None
    hashes = gather_keys(unit.spec["parts"])
    phashes = lance.dataset(storage.lance_uri("phashes"), version=inputs["phashes"], storage_options=options)
    members = lookup_literals(phashes, "phash", [str(int(h)) for h in hashes], COLUMNS, batch=LOOKUP_BATCH)
    summary = {"rows": len(hashes), "hashes": len(hashes), "members": members.num_rows,
               **_write(storage, group_phashes(members)), "deletes": {}}
    table = lance.dataset(storage.lance_uri("duplicates"), version=inputs["duplicates"], storage_options=options)
    old = lookup_literals(table, "group_id", [sql_literal(g) for g in hex_ids(hashes).to_pylist()], ["group_id"],
                          with_row_address=True, batch=LOOKUP_BATCH)
    fragment_of = old["_rowaddr"].to_numpy() >> np.uint64(32)
    for frag_id in np.unique(fragment_of).tolist():
        ids = sorted(set(old["group_id"].filter(pa.array(fragment_of == frag_id)).to_pylist()))
        path = run.scratch_uri("delete", f"f{frag_id:07d}-b{bucket:05d}.json")
        put_atomic(storage.filesystem(), path, json.dumps(ids).encode())
        summary["deletes"][str(frag_id)] = {"path": path, "rows": int((fragment_of == frag_id).sum())}
        summary["outputs"].append(path)
    return summary


def _delete_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: delete the recomputed groups' previous rows from one `duplicates` fragment (the
    only task touching it); returns its new metadata, None when no row is left. Uncommitted."""
    storage = run.storage
    fs = storage.filesystem()
    ids = sorted({g for path in unit.spec["files"] for g in json.loads(fs.cat_file(path))})
    table = lance.dataset(storage.lance_uri("duplicates"), version=run.manifest.inputs["duplicates"],
                          storage_options=storage.lance_storage_options() or None)
    fragment = table.get_fragment(unit.spec["fragment"])
    before = fragment.count_rows()
    meta = fragment.delete(f"group_id IN ({', '.join(sql_literal(g) for g in ids)})")
    removed = before - (meta.num_rows if meta is not None else 0)
    if removed != unit.spec["rows"]:
        raise RuntimeError(f"duplicates fragment {unit.spec['fragment']}: deleted {removed} rows, "
                           f"the reducers found {unit.spec['rows']}")
    return {"rows": removed, "fragment": unit.spec["fragment"], "updated": None if meta is None else meta.to_json()}


def _write(storage: Storage, groups: pa.Table) -> dict[str, Any]:
    """Uncommitted `duplicates` fragments of a reducer's groups, and what it reports of them."""
    uri = storage.lance_uri("duplicates")
    fragments = lance_io.write_fragments(uri, groups, schemas.DUPLICATES, storage.lance_storage_options()) \
        if groups.num_rows else []
    keepers = int(pc.sum(groups["keeper"]).as_py() or 0)
    return {"written": groups.num_rows, "groups": keepers, "losers": groups.num_rows - keepers,
            "fragments": [f.to_json() for f in fragments], "outputs": lance_io.fragment_files(uri, fragments)}
