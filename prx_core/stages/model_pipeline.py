"""Content units through one Ray Data pipeline: the path of the `ray.data.llm` (vLLM) engines.

vLLM engines are Ray Data actors that live as long as one pipeline runs, so units cannot each
start their own. `pipeline_units` is the `work` step of `captions` and `caption_labels` on this
path (their `pin` adds `path: pipeline` to the manifest); the units run in phases of one attempt:
1. prepare: each unit finds its pending contents (the same worker-side lookups as the actor
   path) and writes them to a scratch file; recorded per unit. Only the first units are prepared
   ahead, as Ray tasks, a cluster's CPUs of them at a time until one has pending contents: a run
   with nothing to generate starts no engine, and the others' lookups do not keep the GPUs idle.
2. generate: the units not yet generated stream through one pipeline (prepare or read scratch ->
   the engine stages -> write): the units not prepared ahead are prepared in its input stage,
   while the engines generate for the first ones. Writers write each unit's rows as their own
   fragments and emit one small record per batch; the driver counts rows per unit (its prepare
   record says how many) and, when a unit is complete, records it and hands its fragments to the
   batched appends.
3. fallback (the captioner's caption checks): what the writers held back (a refused first answer)
   streams through a second pipeline with the fallback decoding, per unit, recorded the same way.
   A second engine start, paid only when some caption was refused: Ray Data pipelines do not loop
   back into a running engine.
A crash loses only the units in flight; the rerun skips the recorded ones of every phase
(`PRX_PAUSE_AT=<asset>:generate:<k>` or `<asset>:fallback:<k>` pauses the driver after the k-th
unit of that pass: kill tests).
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
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute.actors import release_idle
from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import quiet_ray_data
from prx_core.compute.units import Unit, UnitResults, UnitRun, execute_unit
from prx_core.stages.stage import StageRun
from prx_core.store.storage import Storage

Prepare = Callable[[Unit, UnitRun], tuple[pa.Table, dict[str, Any]]]  # (pending rows, summary)
Read = Callable[[UnitRun, pa.Table], pa.Table]  # pending rows -> the pipeline's input rows
Write = Callable[[Storage, pa.Table], dict[str, Any]]  # one unit's output rows -> counts and fragments
GENERATED = "g-"  # record prefix of the generate phase
FALLBACK = "f-"  # record prefix of the fallback pass
CARRY = ("unit_id",)  # the column the pipelines pass through: which unit a row belongs to
FALLBACK_CARRY = (*CARRY, "first_problem", "first_tokens")  # and on the fallback pass, the first attempt


def prepare_unit(prepare: Prepare, unit: Unit, run: UnitRun) -> dict[str, Any]:
    """A prepare task: the unit's summary, its pending rows in its scratch file."""
    return prepared_rows(prepare, unit, run)[1]


def prepared_rows(prepare: Prepare, unit: Unit, run: UnitRun) -> tuple[pa.Table, dict[str, Any]]:
    todo, summary = prepare(unit, run)
    uri = write_scratch(run, f"{unit.id}.parquet", todo) if todo.num_rows else run.scratch_uri(f"{unit.id}.parquet")
    return todo, {**summary, "todo": todo.num_rows, "scratch": uri}


def write_scratch(run: UnitRun, name: str, rows: pa.Table) -> str:
    """`rows` as a parquet file under the attempt's scratch folder; its URI."""
    uri = run.scratch_uri(*name.split("/"))
    fs = run.storage.filesystem()
    fs.makedirs(uri.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(uri, "wb") as out:
        pq.write_table(rows, out)
    return uri


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


@dataclass(frozen=True)
class Retry:
    """A second pass over what the first pass's writers held back (their summary's `held`: a table
    of rows to generate again, written to the attempt's scratch by the pass: the driver holds only
    counts and file names), through `pipeline` (the fallback decoding), written by `write`;
    `read(run, pending rows, held rows)` makes its input rows."""

    pipeline: Callable[..., Any]
    read: Callable[[UnitRun, pa.Table, pa.Table], pa.Table]
    write: Write


def pipeline_units(run: StageRun, *, prepare: Prepare, read: Read, pipeline: Callable[..., Any], write: Write,
                   retry: Retry | None = None) -> None:
    """A content stage's `work` on the vLLM path: units prepared ahead until one has pending
    contents, then one pipeline over the units not yet generated (the rest prepared as its input
    stage), then (`retry`) one pipeline over what their writers held back; each completed unit is
    recorded and handed to the batched appends (`run.state["appends"]`). `run.results["units"]` is
    every unit's prepare summary merged with its generated ones."""
    start = time.monotonic()
    attempt, units = run.attempt, run.state["units"]
    assert attempt is not None, "units run inside run_partition"
    recorded = attempt.completed()
    earlier = {u.id: recorded[GENERATED + u.id] for u in units if GENERATED + u.id in recorded}  # a resumed run's
    waiting = [u for u in units if u.id not in earlier]
    prepared = prepare_ahead(run, waiting, prepare, recorded)
    todo: dict[str, tuple[int | None, dict[str, str]]] = {}
    for unit in waiting:
        summary = prepared.get(unit.id)
        if summary is None:  # prepared by the pipeline's input stage
            todo[unit.id] = (None, {"spec": json.dumps({"rows": unit.rows, "spec": unit.spec})})
        elif summary["todo"]:
            todo[unit.id] = (summary["todo"], {"scratch": summary["scratch"]})
    done, ran = Pass(GENERATED, "generate", "generated", CARRY).run(
        run, todo, partial(_unit_input, prepare, read), pipeline, write,
        replaced=lambda unit_id: (prepared.get(unit_id) or attempt.summary(unit_id) or {}).get("retry", []))
    recorded = attempt.completed()
    by_id = {u.id: recorded[u.id] for u in units}  # every unit is prepared by now
    generated = {**earlier, **done}
    if retry is not None:
        held = {unit_id: (s["held"], {"scratch": by_id[unit_id]["scratch"], "held_files": json.dumps(s["held_files"])})
                for unit_id, s in generated.items() if s.get("held")}
        retried, _ = Pass(FALLBACK, "fallback", "regenerated", FALLBACK_CARRY).run(
            run, held, partial(_read_held, retry.read), retry.pipeline, retry.write)
        for unit_id, summary in retried.items():
            merge(generated[unit_id], summary)
    summaries = [dict(by_id[u.id]) for u in units]
    for unit, summary in zip(units, summaries):
        merge(summary, generated.get(unit.id, {}))
        for key in ("held", "held_files"):  # the fallback pass's work list, counted in `fallbacks` once done
            summary.pop(key, None)
    run.results["units"] = UnitResults(summaries, ran, len(earlier), time.monotonic() - start)


def prepare_ahead(run: StageRun, units: list[Unit], prepare: Prepare,
                  recorded: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Prepare the first units, a cluster's CPUs of them, then twice as many, and so on, until one
    has pending contents (or all are prepared): a run with nothing to generate starts no engine
    (in a few rounds), and a run with work starts its engines after one round of lookups, not
    after all of them. Summaries by unit id, those an earlier run of the attempt recorded (`recorded`:
    the attempt's records when this run began) included."""
    import ray

    first, step = 0, max(1, int(ray.cluster_resources().get("CPU", 1)))
    prepared: dict[str, dict[str, Any]] = {}
    while first < len(units):
        batch = units[first: first + step]  # run_units skips the recorded ones
        results = run.units("prepare", batch, partial(prepare_unit, prepare))
        prepared |= zip((u.id for u in batch), results.summaries)
        if any(s["todo"] for s in results.summaries):
            break
        first, step = first + step, 2 * step
    return prepared | {u.id: recorded[u.id] for u in units if u.id in recorded and u.id not in prepared}


@dataclass(frozen=True)
class Pass:
    """One pipeline over units: records under `prefix`, pause points `<asset>:<name>:<k>`, rows seen
    counted under `counter`, the run of the attempt that made them under `<counter>_by`, the
    `carry` columns passed through the pipeline."""

    prefix: str
    name: str
    counter: str
    carry: tuple[str, ...]

    def run(self, run: StageRun, todo: Mapping[str, tuple[int | None, dict[str, str]]], read: Callable[..., pa.Table],
            pipeline: Callable[..., Any], write: Write,
            replaced: Callable[[str], list[str]] = lambda unit_id: []) -> tuple[dict[str, dict[str, Any]], int]:
        """Run the units of `todo` (unit id -> (rows expected, the item `read` makes their rows
        from)) not recorded yet: the summaries of all recorded ones, and how many ran now. Rows
        expected None: the unit is prepared in the pipeline, its count read from its record."""
        import ray.data

        attempt, appends, this_run = run.attempt, run.state["appends"], uuid.uuid4().hex[:12]
        assert attempt is not None
        recorded = {k.removeprefix(self.prefix): v for k, v in attempt.completed().items() if k.startswith(self.prefix)}
        done = {unit_id: recorded[unit_id] for unit_id in todo if unit_id in recorded}
        work = [unit_id for unit_id in todo if unit_id not in done]
        if not work:
            return done, 0
        quiet_ray_data()
        release_idle()  # the engines size themselves to the free resources an idle model actor holds
        skipped = len(done)
        items = [{"unit": unit_id, **todo[unit_id][1]} for unit_id in work]
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            lambda b: _unit_rows(attempt, read, b.to_pylist()[0]), batch_size=1, batch_format="pyarrow")
        written = pipeline(dataset, carry=self.carry).map_batches(partial(_write_units, attempt, write, self.counter),
                                                             batch_size=None, batch_format="pyarrow")
        generating: dict[str, dict[str, Any]] = {}
        expected = {unit_id: rows for unit_id, (rows, _) in todo.items() if rows is not None}
        for record in written.iter_rows():
            summary = generating.setdefault(record["unit"], {self.counter: 0})
            merge(summary, json.loads(record["summary"]))
            if record["unit"] not in expected:  # prepared in the pipeline, before its rows came out
                expected[record["unit"]] = int((attempt.summary(record["unit"]) or {})["todo"])
            if summary[self.counter] == expected[record["unit"]]:
                summary[f"{self.counter}_by"] = this_run  # which run of the attempt: a resumed run keeps the earlier one's
                attempt.record(self.prefix + record["unit"], summary)
                appends.add({**summary, "retry": replaced(record["unit"])})
                done[record["unit"]] = generating.pop(record["unit"])
                if run.progress is not None:
                    run.progress(len(done), len(todo))
                pause_point(f"{attempt.manifest.asset}:{self.name}:{len(done) - skipped}")
        return done, len(work)


def _unit_rows(run: UnitRun, read: Callable[[UnitRun, Mapping[str, str]], pa.Table], item: Mapping[str, str]) -> pa.Table:
    rows = read(run, item)
    return rows.append_column("unit_id", pa.array([item["unit"]] * rows.num_rows, pa.string()))


def _pending(run: UnitRun, item: Mapping[str, str]) -> pa.Table:
    """A unit's pending rows: the prepare phase's scratch file."""
    with run.storage.filesystem().open(item["scratch"], "rb") as handle:
        return pq.read_table(handle, pre_buffer=False)


def _unit_input(prepare: Prepare, read: Read, run: UnitRun, item: Mapping[str, str]) -> pa.Table:
    """The first pass's input rows of a unit: its pending rows, prepared here (and recorded, as a
    prepare task records them) unless prepared ahead."""
    if "scratch" in item:
        return read(run, _pending(run, item))
    described = json.loads(item["spec"])
    pending: list[pa.Table] = []

    def prepare_here(unit: Unit, run: UnitRun) -> dict[str, Any]:
        todo, summary = prepared_rows(prepare, unit, run)
        pending.append(todo)
        return {**summary, "prepared_in": "pipeline"}

    execute_unit(prepare_here, Unit(item["unit"], described["rows"], described["spec"]), run)
    return read(run, pending[0])


def _read_held(read: Callable[[UnitRun, pa.Table, pa.Table], pa.Table], run: UnitRun,
               item: Mapping[str, str]) -> pa.Table:
    fs = run.storage.filesystem()
    parts = []
    for uri in json.loads(item["held_files"]):
        with fs.open(uri, "rb") as handle:
            parts.append(pq.read_table(handle, pre_buffer=False))
    return read(run, _pending(run, item), pa.concat_tables(parts))


def _write_units(run: UnitRun, write: Write, counter: str, batch: pa.Table) -> pa.Table:
    """On a worker: one fragment set per unit present in the batch; one small record each. Rows
    the writer holds back (`held`, a table) go to a scratch file of the attempt: the record names it."""
    records = []
    for unit_id in sorted(set(batch["unit_id"].to_pylist())):
        rows = batch.filter(pc.equal(batch["unit_id"], unit_id))
        summary = {**write(run.storage, rows), counter: rows.num_rows, **engine_summary(rows)}
        held = summary.pop("held", None)
        if held is not None and held.num_rows:
            name = f"held/{unit_id}-{uuid.uuid4().hex[:12]}.parquet"
            summary |= {"held": held.num_rows, "held_files": [write_scratch(run, name, held)]}
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
