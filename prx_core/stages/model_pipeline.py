"""Content units through one Ray Data pipeline: the path of the `ray.data.llm` (vLLM) engines.

vLLM engines are Ray Data actors that live as long as one pipeline runs, so units cannot each
start their own. `pipeline_units` is the `work` step of `captions` and `caption_labels` on this
path (their `pin` adds `path: pipeline` to the manifest); the units run in two phases of one attempt:
1. prepare, as Ray tasks: each unit finds its pending contents (the same worker-side lookups as
   the actor path) and writes them to a scratch file; recorded per unit.
2. generate: the units with pending contents, not yet generated, stream through one pipeline
   (read scratch -> the engine stages -> write). Writers write each unit's rows as their own
   fragments and emit one small record per batch; the driver counts rows per unit and, when a
   unit is complete, records it and hands its fragments to the batched appends.
A crash loses only the units in flight; the rerun skips the recorded ones of both phases
(`PRX_PAUSE_AT=<asset>:generate:<k>` pauses the driver after the k-th generated unit: kill tests).
Each generated unit's record names the run that generated it (`generated_by`, one id per run of
the attempt), so a resumed run's report shows which units it kept. Where the rows carry the
engine's accounting (the vLLM captioner's finish_reason, num_input_tokens, llm_seconds), each
unit's summary adds it up: `engine` {requests, input_tokens, llm_seconds} and `finish_reasons`
{reason: captions}.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import quiet_ray_data
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.stages.stage import StageRun
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


def pipeline_units(run: StageRun, *, prepare: Prepare, read: Read, pipeline: Callable[..., Any], write: Write) -> None:
    """A content stage's `work` on the vLLM path: the prepare phase, then one pipeline over the
    units with pending contents not yet generated; each completed unit is recorded and handed to
    the batched appends (`run.state["appends"]`). `run.results["units"]` is every unit's prepare
    summary merged with its generated one."""
    import ray.data

    start, this_run = time.monotonic(), uuid.uuid4().hex[:12]
    attempt, units, appends = run.attempt, run.state["units"], run.state["appends"]
    assert attempt is not None, "units run inside run_partition"
    prepared = run.units("prepare", units, partial(prepare_unit, prepare))
    done = {k.removeprefix(GENERATED): v for k, v in attempt.completed().items() if k.startswith(GENERATED)}
    by_id = {u.id: s for u, s in zip(units, prepared.summaries)}
    work = [(unit_id, s) for unit_id, s in by_id.items() if s["todo"] and unit_id not in done]
    skipped = len(done)
    if work:
        quiet_ray_data()
        items = [{"unit": unit_id, "scratch": s["scratch"]} for unit_id, s in work]
        wanted = {unit_id: s["todo"] for unit_id, s in work}
        storage = run.storage
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            lambda b: _read_scratch(attempt, read, b.to_pylist()[0]), batch_size=1, batch_format="pyarrow")
        written = pipeline(dataset, carry=("unit_id",)).map_batches(lambda b: _write_units(storage, write, b),
                                                                    batch_size=None, batch_format="pyarrow")
        generating: dict[str, dict[str, Any]] = {}
        for record in written.iter_rows():
            summary = generating.setdefault(record["unit"], {"generated": 0})
            merge(summary, json.loads(record["summary"]))
            if summary["generated"] == wanted[record["unit"]]:
                summary["generated_by"] = this_run  # which run of the attempt: a resumed run keeps the earlier one's
                attempt.record(GENERATED + record["unit"], summary)
                appends.add({**summary, "retry": by_id[record["unit"]].get("retry", [])})
                done[record["unit"]] = generating.pop(record["unit"])
                if run.progress is not None:
                    run.progress(len(done), len(work) + skipped)
                pause_point(f"{attempt.manifest.asset}:generate:{len(done) - skipped}")
    summaries = [dict(p) for p in prepared.summaries]
    for unit, summary in zip(units, summaries):
        merge(summary, done.get(unit.id, {}))
    run.results["units"] = UnitResults(summaries, len(work), skipped, time.monotonic() - start)


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
        summary = {**write(storage, rows), "generated": rows.num_rows, **engine_summary(rows)}
        records.append({"unit": unit_id, "summary": json.dumps(summary)})
    return pa.Table.from_pylist(records, schema=pa.schema([("unit", pa.string()), ("summary", pa.string())]))


def engine_summary(rows: pa.Table) -> dict[str, Any]:
    """The engine's accounting of these rows where they carry it (requests it generated for, their
    prompt tokens and engine seconds, captions per finish_reason); {} otherwise."""
    if "finish_reason" not in rows.column_names:
        return {}
    reasons = [r for r in rows["finish_reason"].to_pylist() if r]
    return {"engine": {"requests": len(reasons),
                       "input_tokens": int(pc.sum(rows["num_input_tokens"]).as_py() or 0),
                       "llm_seconds": round(float(pc.sum(rows["llm_seconds"]).as_py() or 0.0), 4)},
            "finish_reasons": dict(Counter(reasons))}
