"""The work units of a `duplicates` run (prx_core.stages.duplicates.runs plans them): a group unit
(phase `reduce`) writes the groups of one bucket of components as uncommitted `duplicates`
fragments; a delete unit (phase `delete`, incremental runs) removes the recomputed components'
previous rows from one `duplicates` fragment. Each runs as a Ray task and records its summary;
the run commits what they wrote once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from prx_core.compute.units import Unit, UnitRun
from prx_core.stages.duplicates import tasks
from prx_core.stages.duplicates.groups import NODE_COLUMNS, group_component
from prx_core.store import lance_io, schemas
from prx_core.store.lance_io import sql_literal
from prx_core.store.storage import Storage


def group_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the groups of one bucket of components; writes its `duplicates` fragments."""
    tables = tasks.gathered(unit.spec["parts"])
    groups = schemas.DUPLICATES.empty_table()
    if tables:
        rows = pa.concat_tables(tables)
        rows = rows.take(pa.array(np.argsort(rows["_label"].to_numpy(), kind="stable")))
        labels = rows["_label"].to_numpy()
        starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
        confirm = run.manifest.params.get("rule", "keys") != "phash"
        groups = pa.concat_tables([groups] + [group_component(rows.slice(s, e - s).select(NODE_COLUMNS), confirm)
                                              for s, e in zip(starts, np.r_[starts[1:], len(labels)])])
    return {"rows": groups.num_rows, "components": len(set(groups["component_id"].to_pylist())),
            **write_groups(run.storage, groups)}


def delete_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: delete the affected components' previous rows from one `duplicates` fragment (the
    only task touching it); returns its new metadata, None when no row is left. Uncommitted."""
    fragment_id = unit.spec["fragment"]
    ids = sorted({c for t in tasks.gathered(unit.spec["parts"])
                  for c, f in zip(t["component_id"].to_pylist(), t["fragment"].to_pylist()) if f == fragment_id})
    table = lance.dataset(run.storage.lance_uri("duplicates"), version=run.manifest.inputs["duplicates"],
                          storage_options=run.storage.lance_storage_options() or None)
    fragment = table.get_fragment(fragment_id)
    before = fragment.count_rows()
    meta = fragment.delete(f"component_id IN ({', '.join(sql_literal(c) for c in ids)})")
    removed = before - (meta.num_rows if meta is not None else 0)
    if removed != unit.spec["rows"]:
        raise RuntimeError(f"duplicates fragment {fragment_id}: deleted {removed} rows, the lookups found "
                           f"{unit.spec['rows']}")
    return {"rows": removed, "fragment": fragment_id, "updated": None if meta is None else meta.to_json()}


def count_deletes(refs: Sequence[Any]) -> dict[Any, int]:
    """Ray task: rows to delete per `duplicates` fragment and, under None, the affected components."""
    tables = tasks.gathered(refs)
    if not tables:
        return {None: 0}
    rows = pa.concat_tables(tables)
    fragments, counts = np.unique(rows["fragment"].to_numpy(), return_counts=True)
    return {**{int(f): int(n) for f, n in zip(fragments, counts)}, None: len(set(rows["component_id"].to_pylist()))}


def write_groups(storage: Storage, groups: pa.Table) -> dict[str, Any]:
    """Uncommitted `duplicates` fragments of a unit's groups, and what it reports of them."""
    uri = storage.lance_uri("duplicates")
    fragments = lance_io.write_fragments(uri, groups, schemas.DUPLICATES, storage.lance_storage_options()) \
        if groups.num_rows else []
    keepers = groups.filter(pa.array(np.asarray(groups["keeper"].to_numpy(zero_copy_only=False), bool) &
                                     (groups["group_size"].to_numpy() >= 2))).num_rows if groups.num_rows else 0
    losers = groups.num_rows - int(np.asarray(groups["keeper"].to_numpy(zero_copy_only=False), bool).sum()) \
        if groups.num_rows else 0
    return {"written": groups.num_rows, "groups": keepers, "losers": losers,
            "fragments": [f.to_json() for f in fragments], "outputs": lance_io.fragment_files(uri, fragments)}
