"""A stage declared once, and `run_partition`, the one way every stage runs a partition.

A `Stage` names what it reads and writes, the assets it follows (`after`), its code version, its
settings (a frozen dataclass, `prx_core.stages.settings`, with the unit sizes among them, which
`prx_resources.units` offers to operators), its phases of work units, and four steps: `pin` the
input versions the attempt computes from, `work` its phases on Ray workers, `commit` what the
units wrote, and `report`. `run_partition` is the rest, the same for every
stage: the source name checked, the partition lock held, the attempt opened from the manifest
(asset, partition, pinned inputs, code version, the settings that shape outputs or units; its
`volatile` inputs left out of the identity, so a rerun resumes across other partitions' commits), the
steps in order, the attempt finished after the commit, and the report made small for the wire.

The asset layer (through `prx_core.stages.entry.run_stage`), the Ray job entry point
(`prx_core.stages.job`) and the scale benchmark all call it, so a fix to how stages run lands once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prx_core.compute import wire
from prx_core.compute.faults import pause_point
from prx_core.compute.parallel import Throttle
from prx_core.compute.unit_results import condense_report
from prx_core.compute.units import Manifest, Unit, UnitResults, UnitRun, run_units
from prx_core.stages import settings as typed
from prx_core.stages.settings import Settings
from prx_core.stages.unchanged import committed_report, record_committed
from prx_core.store.locks import partition_lock
from prx_core.store.names import validate_source_name
from prx_core.store.storage import Storage

# Every stage takes a Storage and reports its units: on the wire for all of them (prx_core.compute.wire);
# each stage module registers the rest of what it carries as its own WIRE_TYPES.
WIRE_TYPES = wire.register_all(Storage, UnitResults)


S = TypeVar("S", bound=Settings)  # a stage's settings class (prx_core.stages.settings)


@dataclass(frozen=True)
class UnitSize:
    """A setting that sizes work units: it changes how work is cut, never what is written."""

    setting: str  # the stage's keyword, a field of its settings class (e.g. "unit_rows")
    description: str  # what it trades, for the operator (prx_resources.units)


@dataclass(frozen=True)
class Stage(Generic[S]):
    """One pipeline stage: what it is (tables, code version, settings, phases) and its four steps.

    `pin(run)` returns the pinned inputs (and may add manifest params to `run.params` and plans to
    `run.state`); `work(run)` runs the phases through `run.units`; `commit(run)` makes the units'
    outputs live and returns the Lance versions written; `report(run)` builds the report after the
    attempt is finished (it may still raise: a refusal whose rejects are committed for inspection).
    `settings` is the stage's frozen settings dataclass (prx_core.stages.settings): the steps read
    `run.settings.<name>`. Settings in `unpinned` never enter the manifest (time limits, escape
    hatches). `then(report, run)`, when set, runs after the commit, still under the partition lock,
    and returns what the asset reports (`report_type`): a step that rewrites the partition
    (sample-id settlement) or reads back what the stage published, with no other writer in between."""

    name: str  # and its asset's
    reads: tuple[str, ...]  # the tables (and published files: "mds") its steps read
    writes: tuple[str, ...]  # what it writes
    code_version: str  # enters the manifest, and begins its asset's code version (prx_assets.declared)
    report_type: type
    settings: type[S]
    pin: Callable[[StageRun[S]], Mapping[str, Any]]
    work: Callable[[StageRun[S]], None]
    commit: Callable[[StageRun[S]], Mapping[str, int | None]]
    report: Callable[[StageRun[S]], Any]
    phases: tuple[str, ...] = ("units",)
    unit_sizes: tuple[UnitSize, ...] = ()
    unpinned: tuple[str, ...] = ()
    partition: str | None = None  # the one partition (and lock) of an unpartitioned stage
    then: Callable[[Any, StageRun[S]], Any] | None = None
    # `reusable(report)`: whether a run's final report may stand for a later run of the same manifest
    # while its outputs are still there (nothing run or committed then: prx_core.stages.unchanged)
    reusable: Callable[[Any], bool] | None = None
    # pinned inputs the attempt's identity (what a rerun resumes) and the reuse check leave out: a
    # shared table's version that changes with every other partition's run, whose content for this
    # partition another pinned input digests (prx_core.compute.units.Manifest)
    volatile: tuple[str, ...] = ()
    # `spare(storage)`: which uncommitted outputs of an abandoned attempt its discard keeps (`spare(storage)(uri)`):
    # those a published reader may reference (MDS chunks a live index.json names); retention removes them later
    spare: Callable[[Storage], Callable[[str], bool]] | None = None
    # `present(run, report)`: whether the files a reused report describes are still in place (tables are
    # checked by version); a reuse needs both
    present: Callable[[StageRun[S], Any], bool] | None = None
    # the upstream assets its asset follows (its Dagster `deps`, prx_assets.declared): what it reads,
    # each table named by the nearest asset that makes it, which decides what a new upstream version
    # reruns (tests/assets/test_stage_graph.py holds the graph to these declarations)
    after: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """A unit size or unpinned setting that names no field fails here, at import, not in a run."""
        typed.check_declared(self.name, self.settings, [u.setting for u in self.unit_sizes], self.unpinned)

    def defaults(self) -> dict[str, Any]:
        """Each optional setting's default (`prx_resources.units` offers the unit sizes' to operators)."""
        return typed.defaults(self.settings)

    def setting_types(self) -> dict[str, Any]:
        """The declared type of each setting (what the wire carries into `run_stage`)."""
        return typed.types(self.settings)


@dataclass
class StageRun(Generic[S]):
    """One run of a stage over one partition: what its steps share."""

    stage: Stage[S]
    storage: Storage
    partition: str
    settings: S  # the bound settings: `run.settings.unit_rows`
    progress: Throttle | None
    params: dict[str, Any] = field(default_factory=dict)  # the manifest's params
    inputs: Mapping[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # the stage's own plans between its steps
    results: dict[str, UnitResults] = field(default_factory=dict)  # by phase
    versions: Mapping[str, int | None] = field(default_factory=dict)  # written by `commit`
    attempt: UnitRun | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def units(self, phase: str, units: Sequence[Unit], fn: Callable[..., dict[str, Any]], *, progress: bool = True,
              **options: Any) -> UnitResults:
        """Run one phase's units in this attempt; progress lines carry the phase's name after the first."""
        if phase not in self.stage.phases:
            raise ValueError(f"{self.stage.name}: phase {phase!r} is not declared ({', '.join(self.stage.phases)})")
        assert self.attempt is not None, "units run inside run_partition"
        self.results[phase] = run_units(self.attempt, units, fn, phase=phase,
                                        progress=self._progress(phase) if progress else None, **options)
        return self.results[phase]

    def _progress(self, phase: str) -> Throttle | None:
        if self.progress is None or phase == self.stage.phases[0]:
            return self.progress
        return Throttle(self.progress.report, f"{self.progress.label} {phase}", self.progress.seconds, self.progress.unit)


def run_partition(stage: Stage, storage: Storage, source: str | None = None, *, progress: Throttle | None = None,
                  **settings: Any) -> Any:
    """Run `stage` over the partition `source` (or its one partition): lock, pin, open the attempt,
    work, commit, finish, report. A rerun of the same manifest resumes its recorded units."""
    partition = source or getattr(settings.get("spec"), "name", None) or stage.partition
    validate_source_name(partition)
    run = StageRun(stage, storage, partition, bind_settings(stage, settings), progress)
    with partition_lock(storage, stage.name, stage.partition or partition):
        run.params = typed.pinned(run.settings, stage.unpinned)  # the flat dict the manifest always held
        run.inputs = stage.pin(run)
        manifest = Manifest(stage.name, partition, run.inputs, stage.code_version, run.params, stage.volatile)
        reuse = manifest.digest()
        done = committed_report(storage, stage.name, partition, reuse, stage.report_type) if stage.reusable else None
        if done is not None and (stage.present is None or stage.present(run, done)):
            if progress is not None:
                progress.report(f"{progress.label}: unchanged since its last commit (same inputs, code and "
                                "settings): nothing to run")
            return done
        run.attempt = UnitRun.open(storage, manifest, stage.spare(storage) if stage.spare else None)
        run.inputs = run.attempt.manifest.inputs  # a resumed attempt's: the volatile versions it pinned
        pause_point(f"{stage.name}:opened")
        stage.work(run)
        run.versions = stage.commit(run)
        run.attempt.finish()
        report = condense_report(stage.report(run), storage, stage.name, partition, run.attempt.token)
        # still under the lock: a follow-up that rewrites the partition (sample-id settlement) must
        # not let a second writer in between the commit and itself
        final = report if stage.then is None else stage.then(report, run)
    # every commit is recorded (downstream stages follow it: `last_commit`); its report only when a
    # later run of the same manifest may stand on it (a run that left failures to retry may not)
    may_stand = stage.reusable is not None and stage.reusable(final)
    record_committed(storage, stage.name, partition, reuse, run.versions, final if may_stand else None)
    return final


def bind_settings(stage: Stage[S], given: Mapping[str, Any]) -> S:
    """The stage's settings from keywords, with its defaults; an unknown or missing one fails naming them all."""
    return typed.bind(stage.name, stage.settings, given)  # type: ignore[return-value]
