"""How a `duplicates` run regroups on Ray (prx_core.stages.duplicates.stage decides which way; each way
is a plan for its `pin`, a `work` and a `commit` step of the stage). The task bodies are in
prx_core.stages.duplicates.tasks, the work units' in prx_core.stages.duplicates.units; what they
compute, in prx_core.stages.duplicates.groups.

Both ways regroup a set of rows the same way, in layers of tasks over `buckets` parts:

    key entries (by key) -> candidate pairs (by node) -> confirmed edges and row payloads (by node)
    -> connected components (prx_core.compute.components) -> rows with labels (by label) -> groups

- all of them (full): the entries of every `phashes` row of the pinned version; one Overwrite.
- those of the changed sources (incremental): a Bloom filter of the changed rows' keys lets the
  map tasks pass on only the stored keys the changed rows share; the rows that pair with a changed
  row, and the changed sources' previous rows, name the stored components to recompute; those
  components' rows still present, with the new pairs, are regrouped; one task per affected
  `duplicates` fragment deletes the components' previous rows; one Update. An incremental run
  reads every stored key (8 bytes a key) once, and the pHash, signature and rows of what changed.

The group units (phase `reduce`) and deletes (phase `delete`) are work units: a crashed run
recomputes the layers before them (kept in the object store) and resumes its recorded units;
until the single commit the table is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from lance import LanceDataset, LanceOperation

from prx_core.compute.bloom import Bloom
from prx_core.compute.components import connected_components
from prx_core.compute.groupby import bucket_count, fragment_units
from prx_core.compute.row_units import map_groups, plan_row_units
from prx_core.compute.units import COMMITTED, Unit
from prx_core.stages.duplicates import tasks, units
from prx_core.stages.duplicates.groups import NODE_COLUMNS
from prx_core.stages.duplicates.state import Layout
from prx_core.stages.stage import StageRun
from prx_core.store import lance_io, schemas
from prx_core.store.lance_io import sql_literal
from prx_core.store.storage import put_atomic

COLUMNS = NODE_COLUMNS
KEYS_PER_ROW = 7  # match keys of a photo (a flat picture has 8, or 15 near the threshold)
ENTRY_BYTES = 40
EVERY_ROW = "true"
# an incremental run's buckets: its affected rows are few, its lookups (~30 us a key) are not free
KEY_BUCKET_ROWS = 100_000
KEY_BUCKETS = 64
KEY_PART_BYTES = 1 << 20  # a key map task's part per bucket: 256 buckets x 1 MiB a task, ~840 tasks at 1B rows


@dataclass(frozen=True)
class ShufflePlan:
    """What a full run's layers hold, from the row count alone (tests check it at a billion rows)."""

    rows: int
    buckets: int
    map_tasks: int

    @property
    def entries(self) -> int:
        return self.rows * KEYS_PER_ROW

    @property
    def bytes_per_bucket(self) -> int:
        """Key entries a pair task sorts (the largest single task of the run)."""
        return -(-self.entries // self.buckets) * ENTRY_BYTES

    @property
    def driver_refs(self) -> int:
        """Object references the driver holds at once: the widest layer (map outputs, or a layer of
        `buckets` tasks with 2 x `buckets` + 1 outputs each)."""
        return max(self.map_tasks * self.buckets, self.buckets * (2 * self.buckets + 1))


def shuffle_plan(units: Sequence[Unit], rows_per_bucket: int) -> tuple[ShufflePlan, list[list[dict]]]:
    """A full run's buckets and map tasks for these row units."""
    rows = sum(u.rows for u in units)
    buckets = bucket_count(rows * KEYS_PER_ROW, rows_per_bucket)
    groups = map_groups(units, buckets, ENTRY_BYTES * KEYS_PER_ROW, part_bytes=KEY_PART_BYTES)
    return ShufflePlan(rows, buckets, len(groups)), groups


def plan_all(run: StageRun, phashes: LanceDataset) -> dict[str, Any]:
    """A full run's pinned inputs; its map units and bucket count (`run.params`, `run.state`)."""
    units = run.state["map_units"] = fragment_units(phashes, run.settings.unit_rows)
    plan, run.state["map_groups"] = shuffle_plan(units, run.settings.rows_per_bucket)
    run.state["buckets"] = plan.buckets
    run.params.update(mode="full", buckets=run.state["buckets"])
    return {"phashes": phashes.version}


def reduce_all(run: StageRun) -> None:
    """Every group, from every row of the pinned `phashes`."""
    storage, phashes, buckets = run.storage, run.state["phashes"], run.state["buckets"]
    calls = [(storage.lance_uri("phashes"), phashes.version, specs, EVERY_ROW, storage.lance_storage_options(), buckets,
              [], run.settings.rule) for specs in run.state["map_groups"]]
    _regroup(run, lambda: _scatter(tasks.map_units, calls, buckets))


def commit_all(run: StageRun) -> dict[str, Any]:
    """One Overwrite commit of the group units' fragments; returns the report's fields."""
    options, uri, table = run.storage.lance_storage_options(), run.storage.lance_uri("duplicates"), run.state["table"]
    grouped, units = run.results["reduce"], run.state["map_units"]
    fragments = lance_io.fragments_from_json(f for s in grouped.summaries for f in s["fragments"])
    _committing(run)
    LanceDataset.commit(uri, LanceOperation.Overwrite(schemas.DUPLICATES, fragments),
                        read_version=table.version if table else None, storage_options=options or None)
    return {"mode": "full", "rows_read": sum(u.rows for u in units), "map_units": len(units), **_counts(run)}


def plan_changed(run: StageRun, phashes: LanceDataset, table: LanceDataset, layout: Layout,
                 changed: list[str]) -> dict[str, Any]:
    """An incremental run's pinned inputs: the changed sources' rows, every row's keys, and the
    changed sources' previous `duplicates` rows."""
    predicate = run.state["predicate"] = f"source IN ({', '.join(sql_literal(s) for s in changed)})"
    current = run.state["map_units"] = fragment_units(phashes, run.settings.unit_rows, layout.matched(changed))
    run.state["all_units"] = fragment_units(phashes, run.settings.unit_rows)
    _, previous = plan_row_units(run.storage.lance_uri("duplicates"), predicate, run.settings.unit_rows,
                                 run.storage.lance_storage_options(), version=table.version)
    run.state["previous_units"], run.state["changed"] = previous, changed
    rows = sum(u.rows for u in current) * KEYS_PER_ROW + sum(u.rows for u in previous)
    run.state["buckets"] = bucket_count(rows, min(run.settings.rows_per_bucket, KEY_BUCKET_ROWS), KEY_BUCKETS)
    run.params.update(mode="incremental", buckets=run.state["buckets"])
    return {"phashes": phashes.version, "duplicates": table.version, "changed": changed}


def reduce_changed(run: StageRun) -> None:
    """The components the changed sources touch, regrouped; then one unit per affected `duplicates`
    fragment deletes those components' previous rows."""
    import ray

    storage, options, buckets = run.storage, run.storage.lance_storage_options(), run.state["buckets"]
    phashes, table, changed = run.state["phashes"], run.state["table"], run.state["changed"]
    uri, table_uri = storage.lance_uri("phashes"), storage.lance_uri("duplicates")
    deletes: list[Any] = []

    def affected() -> list[list[Any]]:
        """The key entries of the affected rows, by key (and `deletes` filled in)."""
        current = run.state["map_units"]
        words = len(Bloom.sized(sum(u.rows for u in current) * KEYS_PER_ROW).words)
        blooms = [ray.remote(tasks.bloom_of_units).remote(uri, phashes.version, specs, run.state["predicate"],
                                                          options, words, run.settings.rule)
                  for specs in map_groups(current, 1, 64)]
        bloom = ray.remote(_union).remote(blooms, words)  # merged on a worker: ~10 bits a key, not the driver's
        calls = [(uri, phashes.version, specs, EVERY_ROW, options, buckets, changed, run.settings.rule, bloom)
                 for specs in map_groups(run.state["all_units"], buckets, ENTRY_BYTES, part_bytes=KEY_PART_BYTES)]
        entries = _scatter(tasks.map_units, calls, buckets)
        paired = _layer(tasks.pair_bucket, [(refs, buckets, True) for refs in entries], buckets + 1)
        run.state["skipped_keys"] = sum(ray.get([out[buckets] for out in paired]))
        seeds = _by_bucket(paired, buckets)
        stored = _scatter(tasks.seed_components, [(seeds[b], uri, phashes.version, table_uri, table.version, options,
                                                   buckets) for b in range(buckets)], buckets)
        previous = _scatter(tasks.previous_components, [
            (table_uri, table.version, specs, run.state["predicate"], options, buckets)
            for specs in map_groups(run.state["previous_units"], buckets, 16)], buckets)
        members = _layer(tasks.component_members, [(stored[b] + previous[b], table_uri, table.version, uri,
                                                    phashes.version, options, buckets) for b in range(buckets)],
                         buckets + 1)
        deletes.extend(out[buckets] for out in members)
        nodes = _by_bucket(members, buckets)
        return _scatter(tasks.map_nodes, [(uri, phashes.version, seeds[b] + nodes[b], options, buckets,
                                           run.settings.rule) for b in range(buckets)], buckets)

    _regroup(run, affected, lazy=False)  # the deletes need the layers even when every group unit is done
    fragments = _delete_targets(deletes)
    run.state["affected_components"] = fragments.pop(None, 0)
    run.units("delete", [Unit(f"d{f:07d}", rows, {"fragment": f, "rows": rows, "parts": deletes})
                         for f, rows in sorted(fragments.items())], units.delete_unit)


def commit_changed(run: StageRun) -> dict[str, Any]:
    """One Update commit (none when nothing changed); returns the report's fields."""
    options, uri, table = run.storage.lance_storage_options(), run.storage.lance_uri("duplicates"), run.state["table"]
    grouped, deleted = run.results["reduce"], run.results["delete"]
    removed = [s["fragment"] for s in deleted.summaries if s["updated"] is None]
    updated = lance_io.fragments_from_json(s["updated"] for s in deleted.summaries if s["updated"] is not None)
    new = lance_io.fragments_from_json(f for s in grouped.summaries for f in s["fragments"])
    if removed or updated or new:
        _committing(run)
        op = LanceOperation.Update(removed_fragment_ids=removed, updated_fragments=updated, new_fragments=new)
        LanceDataset.commit(uri, op, read_version=table.version, storage_options=options or None)
    current, previous = run.state["map_units"], run.state["previous_units"]
    return {"mode": "incremental", "map_units": len(current) + len(previous), "rows_read": sum(u.rows for u in current),
            "previous_rows_read": sum(u.rows for u in previous), "rows_deleted": deleted.total("rows"),
            "affected_components": run.state.get("affected_components", 0), **_counts(run)}


def _regroup(run: StageRun, entries: Callable[[], list[list[Any]]], lazy: bool = True) -> None:
    """From key entries (per bucket, refs; `lazy`: computed only when a group unit is left to run)
    to the group units' fragments (phase `reduce`)."""
    import ray

    buckets = run.state["buckets"]
    assert run.attempt is not None
    done = {int(u[1:]) for u in run.attempt.completed() if u.startswith("b")}
    parts: list[list[Any]] = [[] for _ in range(buckets)]
    if len(done) < buckets or not lazy:
        storage, phashes = run.storage, run.state["phashes"]
        paired = _layer(tasks.pair_bucket, [(refs, buckets, False) for refs in entries()], buckets + 1)
        run.state["skipped_keys"] = run.state.get("skipped_keys", 0) + sum(ray.get([o[buckets] for o in paired]))
        pairs = _by_bucket(paired, buckets)
        confirmed = _layer(tasks.confirm_bucket, [(pairs[b], storage.lance_uri("phashes"), phashes.version,
                                                   storage.lance_storage_options(), buckets, run.settings.rule)
                                                  for b in range(buckets)],
                           2 * buckets + 1)
        counts = ray.get([out[2 * buckets] for out in confirmed])
        run.state["pairs"] = (sum(c[0] for c in counts), sum(c[1] for c in counts))
        edges = _by_bucket(confirmed, buckets)
        payloads = [[out[buckets + b] for out in confirmed] for b in range(buckets)]
        labels, run.state["rounds"] = connected_components(edges, buckets)
        parts = _by_bucket(_layer(tasks.label_bucket, [(labels[b], payloads[b], buckets) for b in range(buckets)],
                                  buckets), buckets)
    run.units("reduce", [Unit(f"b{b:05d}", 0, {"bucket": b, "parts": parts[b]}) for b in range(buckets)],
              units.group_unit)


def _delete_targets(deletes: Sequence[Any]) -> dict[Any, int]:
    """Rows to delete per `duplicates` fragment (and, under None, the affected components): counts
    computed where the ids are (one small task), never the ids in the driver."""
    import ray

    return ray.get(ray.remote(units.count_deletes).remote(list(deletes)))


def _counts(run: StageRun) -> dict[str, Any]:
    grouped = run.results["reduce"]
    candidates, confirmed = run.state.get("pairs", (0, 0))
    return {"buckets": run.state["buckets"], "rows_written": grouped.total("written"), "units": grouped,
            "member_rows": grouped.total("written"), "candidate_pairs": candidates, "confirmed_pairs": confirmed,
            "skipped_keys": run.state.get("skipped_keys", 0), "rounds": run.state.get("rounds", 0)}


def _committing(run: StageRun) -> None:
    """Mark the attempt committed BEFORE the commit: if the driver dies right after it, the next
    run (another manifest: its state is stale, so it recomputes all) must not delete the files
    the table now uses as an abandoned attempt's outputs. Dying before it leaks files instead.
    (`run_partition` marks it again when it finishes the attempt.)"""
    assert run.attempt is not None
    put_atomic(run.storage.filesystem(), f"{run.attempt.uri}/{COMMITTED}", b"")


def _union(refs: list[Any], words: int) -> Bloom:
    """Ray task: one Bloom filter of the map tasks' filters."""
    import ray

    merged = Bloom(np.zeros(words, np.uint64))
    for bloom in ray.get(list(refs)):
        merged = merged.union(bloom)
    return merged


def _layer(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], returns: int) -> list[Any]:
    """One task per call, each with `returns` outputs (a list of refs per task)."""
    import ray

    task = ray.remote(fn).options(num_returns=returns)
    outputs = [task.remote(*args) for args in calls]
    return [out if returns > 1 else [out] for out in outputs]


def _scatter(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], buckets: int) -> list[list[Any]]:
    """Map tasks whose outputs are split by bucket: per bucket, the refs of its parts."""
    return _by_bucket(_layer(fn, calls, buckets), buckets)


def _by_bucket(outputs: Sequence[Sequence[Any]], buckets: int) -> list[list[Any]]:
    return [[out[b] for out in outputs] for b in range(buckets)]
