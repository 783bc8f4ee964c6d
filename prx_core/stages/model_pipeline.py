"""Content units through one Ray Data pipeline: the path of the `ray.data.llm` (vLLM) engines.

vLLM engines are Ray Data actors that live as long as one pipeline runs, so units cannot each
start their own. The units run in two phases of one attempt (`UnitRun`):
1. prepare, as Ray tasks: each unit finds its pending contents (the same worker-side lookups as
   the actor path) and writes them to a scratch file; recorded per unit.
2. generate: the units with pending contents, not yet generated, stream through one pipeline
   (read scratch -> the engine stages -> write). Writers write each unit's rows as their own
   fragments and emit one small record per batch; the driver counts rows per unit and, when a
   unit is complete, records it and hands its fragments to the batched appends.
A crash loses only the units in flight; the rerun skips the recorded ones of both phases.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute.parallel import Throttle, quiet_ray_data
from prx_core.compute.units import Manifest, Unit, UnitResults, UnitRun, run_units
from prx_core.store.names import validate_source_name
from prx_core.stages.contents import UNIT_ROWS, plan_content_units
from prx_core.upkeep.appends import BatchedAppend
from prx_core.store.storage import Storage

Prepare = Callable[[Unit, UnitRun], tuple[pa.Table, dict[str, Any]]]  # (pending rows, summary)
Read = Callable[[UnitRun, pa.Table], pa.Table]  # pending rows -> the pipeline's input rows
Write = Callable[[Storage, pa.Table], dict[str, Any]]  # one unit's output rows -> counts and fragments
GENERATED = "g-"  # record prefix of the generate phase


def prepare_unit(prepare: Prepare, unit: Unit, run: UnitRun) -> dict[str, Any]:
    todo, summary = prepare(unit, run)
    uri = run.scratch_uri(f"{unit.id}.parquet")
    if todo.num_rows:
        fs = run.storage.filesystem()
        fs.makedirs(uri.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(uri, "wb") as out:
            pq.write_table(todo, out)
    return {**summary, "todo": todo.num_rows, "scratch": uri}


def merge(into: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Add one batch's summary to its unit's: numbers add up, counters merge, lists extend."""
    for key, value in part.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, dict, list)):
            into[key] = value
        elif isinstance(value, dict):
            into[key] = dict(Counter(into.get(key) or {}) + Counter(value))
        elif isinstance(value, list):
            into[key] = list(into.get(key) or []) + value
        else:
            into[key] = into.get(key, 0) + value


def run_pipeline_stage(
    storage: Storage, source: str, table: str, code_version: str, params: Mapping[str, Any], *,
    prepare: Prepare, read: Read, pipeline: Callable[..., Any], write: Write, appends: BatchedAppend,
    progress: Throttle | None = None, unit_rows: int = UNIT_ROWS,
) -> tuple[UnitResults, dict[str, int]]:
    import ray.data

    validate_source_name(source)
    start = time.monotonic()
    inputs, units = plan_content_units(storage, source, unit_rows)
    appends.commit_recorded(UnitRun.recorded(storage, table, source))
    run = UnitRun.open(storage, Manifest(table, source, inputs, code_version, {**params, "unit_rows": unit_rows,
                                                                               "path": "pipeline"}))
    prepared = run_units(run, units, lambda unit, run: prepare_unit(prepare, unit, run), progress=progress,
                         phase="prepare")
    done = {k.removeprefix(GENERATED): v for k, v in run.completed().items() if k.startswith(GENERATED)}
    by_id = {u.id: s for u, s in zip(units, prepared.summaries)}
    work = [(unit_id, s) for unit_id, s in by_id.items() if s["todo"] and unit_id not in done]
    skipped = len(done)
    if work:
        quiet_ray_data()
        items = [{"unit": unit_id, "scratch": s["scratch"]} for unit_id, s in work]
        wanted = {unit_id: s["todo"] for unit_id, s in work}
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            lambda b: _read_scratch(run, read, b.to_pylist()[0]), batch_size=1, batch_format="pyarrow")
        written = pipeline(dataset, carry=("unit_id",)).map_batches(lambda b: _write_units(storage, write, b), batch_size=None,
                                                batch_format="pyarrow")
        partial: dict[str, dict[str, Any]] = {}
        for record in written.iter_rows():
            summary = partial.setdefault(record["unit"], {"generated": 0})
            merge(summary, json.loads(record["summary"]))
            if summary["generated"] == wanted[record["unit"]]:
                run.record(GENERATED + record["unit"], summary)
                appends.add({**summary, "retry": by_id[record["unit"]].get("retry", [])})
                done[record["unit"]] = partial.pop(record["unit"])
                if progress is not None:
                    progress(len(done), len(work) + skipped)
    appends.finish()
    run.finish()
    summaries = [dict(p) for p in prepared.summaries]
    for unit, summary in zip(units, summaries):
        merge(summary, done.get(unit.id, {}))
    return UnitResults(summaries, len(work), skipped, time.monotonic() - start), inputs


def _read_scratch(run: UnitRun, read: Read, item: Mapping[str, str]) -> pa.Table:
    with run.storage.filesystem().open(item["scratch"], "rb") as handle:
        todo = pq.read_table(handle, pre_buffer=False)
    rows = read(run, todo)
    return rows.append_column("unit_id", pa.array([item["unit"]] * rows.num_rows, pa.string()))


def _write_units(storage: Storage, write: Write, batch: pa.Table) -> pa.Table:
    """On a worker: one fragment set per unit present in the batch; one small record each."""
    records = []
    for unit_id in sorted(set(batch["unit_id"].to_pylist())):
        rows = batch.filter(pc.equal(batch["unit_id"], unit_id))
        summary = {**write(storage, rows), "generated": rows.num_rows}
        records.append({"unit": unit_id, "summary": json.dumps(summary)})
    return pa.Table.from_pylist(records, schema=pa.schema([("unit", pa.string()), ("summary", pa.string())]))
