"""Work units with checkpoints: how a stage runs a partition of any size and resumes after a crash.

A stage cuts its partition into fixed, reproducible units (a group of source files, a row range
of a pinned Lance version, a chunk of one MDS stream). Each unit runs as one Ray task that writes
its outputs (uncommitted Lance fragments, MDS chunk folders, scratch files) and then records its
completion, a small JSON summary, under the corpus root:

    <root>/_runs/<asset>/<partition>/<manifest digest>/run.json        the attempt: manifest, token
                                                        started/<unit>    one per unit begun
                                                        done/<unit>.json  one per completed unit
                                                        scratch/          intermediate files

An attempt is identified by its `Manifest` (asset, partition, pinned input versions, code
version) without its `volatile` inputs: versions of shared tables that every other partition's
runs move, whose content for this partition other pinned inputs digest. Opening a manifest of the
same identity again (a rerun, a Dagster retry, a rerun after other sources moved the shared tables)
skips every recorded unit, and the attempt goes on reading the volatile versions it first pinned;
opening another one starts over and deletes the earlier attempts with their uncommitted outputs
(what their records list under `outputs`) but those `spare` says a reader may hold (a chunk a
published index names). The driver holds one summary per unit, never rows; after its single
commit it calls `UnitRun.finish()`, which forgets the attempt.
Anchor: LanceDB Geneva checkpoints each batch of a backfill and skips finished ones on resume.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import resource
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from prx_core.compute.actors import ModelHost, imap_actors
from prx_core.compute.attempts import discard, join_path, list_children, stem
from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import TaskFailed, Throttle, imap_tasks
from prx_core.compute.unit_results import UnitResults
from prx_core.store.names import NAME_PATTERN
from prx_core.store.storage import COMMITTED, RUNS, Storage, put_atomic

UNIT_SECONDS = 4 * 3600  # default time limit of one unit: several times a default-sized unit's run
# when the unit running in this thread first began (wall clock, its `started` marker): a unit that
# must stop in time (`samples` fetching URLs) counts its time limit from there
UNIT_BEGAN: contextvars.ContextVar[float | None] = contextvars.ContextVar("prx_unit_began", default=None)


@dataclass(frozen=True)
class Manifest:
    """What an attempt computes: the same manifest always yields the same outputs."""

    asset: str
    partition: str
    inputs: Mapping[str, Any]  # pinned input versions (Lance versions, a source fingerprint)
    code_version: str
    params: Mapping[str, Any] = field(default_factory=dict)  # unit sizes and other knobs that shape units
    # inputs the identity leaves out: shared tables' versions that other partitions' runs move, whose
    # content for this partition other inputs digest (a partition signature, the source's own runs)
    volatile: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for what, name in (("asset", self.asset), ("partition", self.partition)):
            if not NAME_PATTERN.match(name):  # both become path segments under the corpus root
                raise ValueError(f"{what} {name!r} must match [a-z0-9_]+")

    def digest(self) -> str:
        """The attempt's identity: everything but the volatile inputs (and without a volatile input,
        the digest manifests always had: attempts and reuse records made before stay valid)."""
        payload = asdict(self)
        del payload["volatile"]
        payload["inputs"] = {k: v for k, v in self.inputs.items() if k not in self.volatile}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Unit:
    """One task: a stable id (sorts in plan order), the rows it covers (for rates and ETA; 0 when
    unknown before reading, e.g. a group of tar shards) and the JSON-able description its worker
    function reads. A worker's summary reports the rows it did under `rows`."""

    id: str
    rows: int
    spec: Mapping[str, Any]


@dataclass(frozen=True)
class UnitRun:
    """One attempt of one manifest; pickles into Ray tasks, which record their own completion."""

    storage: Storage
    manifest: Manifest
    token: str  # unique per attempt: names of outputs readers may later see (MDS chunk folders)
    pass_id: str = ""  # unique per `run_units` call: a unit's time limit counts from its first start in it

    @property
    def uri(self) -> str:
        return self.storage.uri(RUNS, self.manifest.asset, self.manifest.partition, self.manifest.digest())

    def scratch_uri(self, *parts: str) -> str:
        return self.storage.uri(RUNS, self.manifest.asset, self.manifest.partition, self.manifest.digest(),
                                "scratch", *parts)

    @classmethod
    def open(cls, storage: Storage, manifest: Manifest, spare: Callable[[str], bool] | None = None) -> UnitRun:
        """Resume the attempt of `manifest`'s identity, or start one after removing every other
        attempt of the same (asset, partition) together with its uncommitted outputs, but those
        `spare(uri)` keeps (outputs a published reader may reference: retention removes them later).

        A resumed attempt keeps the volatile versions it first pinned (its returned manifest holds
        them): every unit of one attempt reads one snapshot of each shared table, so units done
        before a crash and units done after it join the same rows, and the versions retention
        keeps for the attempt (`run.json`) are the ones it reads."""
        fs = storage.filesystem()
        base = storage.uri(RUNS, manifest.asset, manifest.partition)
        state = storage.uri(RUNS, manifest.asset, manifest.partition, manifest.digest(), "run.json")
        fs.invalidate_cache()
        if fs.exists(state):
            record = json.loads(fs.cat_file(state))
            return cls(storage, resumed(manifest, record["manifest"].get("inputs", {})), record["token"])
        for other in list_children(fs, base):
            discard(fs, other, spare)
        run = cls(storage, manifest, uuid.uuid4().hex[:12])
        payload = {"manifest": asdict(manifest), "token": run.token, "started": time.time()}
        put_atomic(fs, state, json.dumps(payload, sort_keys=True, default=str).encode())
        return run

    @staticmethod
    def recorded(storage: Storage, asset: str, partition: str) -> list[dict[str, Any]]:
        """Summaries of the completed units of every uncommitted attempt of (asset, partition):
        results a stage that commits as it goes may still have to commit (before `open` of a new
        manifest discards those attempts)."""
        fs = storage.filesystem()
        summaries: list[dict[str, Any]] = []
        for attempt in list_children(fs, storage.uri(RUNS, asset, partition)):
            if fs.exists(join_path(attempt, COMMITTED)):
                continue
            paths = [p for p in list_children(fs, join_path(attempt, "done")) if p.endswith(".json")]
            summaries += [json.loads(data) for data in (fs.cat(paths) if paths else {}).values()]
        return summaries

    def record(self, unit_id: str, summary: Mapping[str, Any]) -> None:
        put_atomic(self.storage.filesystem(), join_path(self.uri, "done", f"{unit_id}.json"),
                   json.dumps(summary, sort_keys=True).encode())

    def mark_started(self, unit_id: str) -> float:
        """A marker: which units were running when a run died (the work a resume redoes). It holds
        when the unit first began in this pass (wall clock), which it returns: a unit Ray retries
        keeps counting its time limit from there, as the driver does."""
        fs, marker = self.storage.filesystem(), join_path(self.uri, "started", unit_id)
        try:
            found = json.loads(fs.cat_file(marker))
            if found["pass"] == self.pass_id:
                return float(found["began"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        began = time.time()
        put_atomic(fs, marker, json.dumps({"began": began, "pass": self.pass_id}).encode())
        return began

    def has_started(self, unit_id: str) -> bool:
        """Whether a worker began the unit (in this attempt or a run of it that died)."""
        fs, marker = self.storage.filesystem(), join_path(self.uri, "started", unit_id)
        fs.invalidate_cache(marker)  # s3fs caches listings: a marker written since must be seen
        return fs.exists(marker)

    def started(self) -> set[str]:
        return {stem(p) for p in list_children(self.storage.filesystem(), join_path(self.uri, "started"))}

    def summary(self, unit_id: str) -> dict[str, Any] | None:
        """The recorded summary of one unit, None before it completes (one read)."""
        fs = self.storage.filesystem()
        try:
            return json.loads(fs.cat_file(join_path(self.uri, "done", f"{unit_id}.json")))
        except FileNotFoundError:
            return None

    def completed(self) -> dict[str, dict[str, Any]]:
        """Summaries of the recorded units, by unit id (one listing and one read per unit)."""
        fs = self.storage.filesystem()
        paths = [p for p in list_children(fs, join_path(self.uri, "done")) if p.endswith(".json")]
        blobs = fs.cat(paths) if paths else {}
        return {stem(path): json.loads(data) for path, data in blobs.items()}

    def finish(self) -> None:
        """After the commit: mark the attempt committed (its outputs are live now), then forget it."""
        fs = self.storage.filesystem()
        put_atomic(fs, join_path(self.uri, COMMITTED), b"")
        fs.rm(self.uri, recursive=True)


def resumed(manifest: Manifest, pinned: Mapping[str, Any]) -> Manifest:
    """`manifest` with the volatile inputs the resumed attempt pinned (`pinned`, from its run.json):
    the rest of its inputs are equal by identity."""
    kept = {k: pinned[k] for k in manifest.volatile if k in pinned and k in manifest.inputs}
    return replace(manifest, inputs={**manifest.inputs, **kept}) if kept else manifest


UnitFn = Callable[[Unit, UnitRun], dict[str, Any]]
ModelUnitFn = Callable[[ModelHost, Unit, UnitRun], dict[str, Any]]
FailedFn = Callable[[Unit, UnitRun, str], Mapping[str, Any]]


@dataclass(frozen=True)
class ModelSpec:
    """How units that need a model run: `actors` Ray actors, each building `factory()` once."""

    factory: Callable[[], Any]
    actors: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    runtime_env: dict[str, Any] | None = None


class UnitFailed(RuntimeError):
    """A unit still failed after its retries; the units recorded so far are kept for the rerun."""


def run_units(run: UnitRun, units: Sequence[Unit], fn: UnitFn | ModelUnitFn, *, progress: Throttle | None = None,
              num_cpus: float = 1.0, max_retries: int = 2, max_in_flight: int | None = None,
              phase: str = "units", model: ModelSpec | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              time_limit_s: float | None = UNIT_SECONDS, on_failed: FailedFn | None = None) -> UnitResults:
    """Run every unit not yet recorded as one Ray task each (at most `max_in_flight` at once, by
    default twice the cluster's CPUs), in plan order, completions in any order.

    A task is retried `max_retries` times (a worker that died, a transient storage error) and
    cancelled after `time_limit_s` (retries included; a hang, or a worker Ray keeps restarting
    after out-of-memory kills). A unit that still fails stops the run naming the unit, or, with
    `on_failed`, is recorded as `on_failed(unit, run, message)` plus that `failed` message (the
    stage writes its loss as rejects there, on the driver) while the other units go on.
    With `PRX_PAUSE_AT=<asset>:<phase>:<k>` the driver pauses after the k-th completion of this
    call (kill tests). A stage with several passes runs each as a `phase` with its own unit ids.
    With `model`, units run on `model.actors` actors that each build the model once, and
    `fn(host, unit, run)` uses it through `host.run` (compute.actors; no time limit there).
    `on_result` sees each new summary as it arrives (batched commits of shared tables).
    """
    start = time.monotonic()
    run = replace(run, pass_id=uuid.uuid4().hex[:12])
    ids = {u.id for u in units}
    if len(ids) != len(units):
        raise ValueError(f"{run.manifest.asset}: unit ids are not unique")
    done = {k: v for k, v in run.completed().items() if k in ids}
    skipped = len(done)
    rows_done = sum(int(s.get("rows", 0)) for s in done.values())
    total_rows = sum(u.rows for u in units)  # 0 when units cannot know their rows before reading
    if progress is not None:
        progress.begin(skipped, rows_done)
    todo = [u for u in units if u.id not in done]
    calls = ((fn, unit, run) for unit in todo)
    if model is None:
        results = imap_tasks(_execute, calls, num_cpus=num_cpus, max_retries=max_retries, max_in_flight=max_in_flight,
                             time_limit_s=time_limit_s, began=lambda n: run.has_started(todo[n].id),
                             yield_failures=on_failed is not None)
    else:
        results = imap_actors(model.factory, _execute_on_actor, calls, actors=model.actors, num_cpus=model.num_cpus,
                              num_gpus=model.num_gpus, max_retries=max_retries, runtime_env=model.runtime_env)
    ran = 0
    try:
        for number, summary in results:
            if isinstance(summary, TaskFailed):
                summary = _record_failure(run, todo[number], summary, on_failed, max_retries)
            if on_result is not None:
                on_result(summary)
            done[todo[number].id] = summary
            ran += 1
            rows_done += int(summary.get("rows", todo[number].rows))
            if progress is not None:
                progress(len(done), len(units), rows_done, total_rows)
            pause_point(f"{run.manifest.asset}:{phase}:{ran}")
    except TaskFailed as exc:
        raise UnitFailed(f"{run.manifest.asset}[{run.manifest.partition}] unit {todo[exc.number].id} "
                         f"{_failure_text(exc, max_retries)}"[:2000]) from exc
    return UnitResults([done[u.id] for u in units], ran, skipped, time.monotonic() - start)


def _failure_text(exc: TaskFailed, max_retries: int) -> str:
    if isinstance(exc.cause, TimeoutError):
        return f"timed out: {exc.cause}"
    return f"failed after {max_retries} retries: {type(exc.cause).__name__}: {exc.cause}"


def _record_failure(run: UnitRun, unit: Unit, exc: TaskFailed, on_failed: FailedFn | None,
                    max_retries: int) -> dict[str, Any]:
    """A unit that kept failing, as the stage's summary of its loss; recorded, so a resume of the
    same attempt does not spend another time limit on it."""
    assert on_failed is not None  # failures are yielded only with a handler
    message = f"unit {unit.id} {_failure_text(exc, max_retries)}"[:1000]
    summary = {**dict(on_failed(unit, run, message)), "unit": unit.id, "rows_planned": unit.rows, "failed": message}
    summary.setdefault("rows", 0)
    run.record(unit.id, summary)
    return summary


def process_read_bytes() -> int | None:
    """Bytes this process has read so far (Linux `rchar`: every read of a file, page cache hits
    included, as an object store would serve them; Lance's own counters agree on its reads), None
    where /proc is missing. A unit's difference (`read_bytes` in its summary) is what it read: how
    its cost grows with the corpus. A model actor runs two units at once (UNITS_PER_ACTOR): there
    it is the process's reads while the unit ran, an upper bound."""
    try:
        with open("/proc/self/io") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def _execute_on_actor(host: ModelHost, fn: ModelUnitFn, unit: Unit, run: UnitRun) -> dict[str, Any]:
    return _execute(fn, unit, run, host)


def execute_unit(fn: UnitFn, unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Run one unit in this process as a unit task runs it (a pipeline's input stage): its summary
    with the unit's accounting, recorded."""
    return _execute(fn, unit, run)


def _execute(fn: UnitFn | ModelUnitFn, unit: Unit, run: UnitRun, *host: ModelHost) -> dict[str, Any]:
    """On the worker: run the unit, then record its completion (outputs first, record last)."""
    import ray

    began, read_before = time.monotonic(), process_read_bytes()
    token = UNIT_BEGAN.set(run.mark_started(unit.id))
    try:
        summary = dict(fn(*host, unit, run))
    finally:
        UNIT_BEGAN.reset(token)
    read_after = process_read_bytes()
    if read_before is not None and read_after is not None:
        summary["read_bytes"] = read_after - read_before
    summary.update(unit=unit.id, rows_planned=unit.rows, seconds=round(time.monotonic() - began, 3),
                   worker_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   node=ray.get_runtime_context().get_node_id())
    run.record(unit.id, summary)
    return summary
