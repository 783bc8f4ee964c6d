"""Stage `duplicates` (global): groups of copies of one picture across every source.

Copies are found by their match keys and confirmed by their signatures (prx_core.image.fingerprint);
groups are the connected components of confirmed pairs, cut around keepers so that every member is
confirmed with its keeper directly (prx_core.stages.duplicates.groups). The keeper is the copy
with the most pixels; among equal sizes a lossless file, then the highest estimated JPEG quality,
then the most bytes, then the smallest `sample_id`, so the choice never depends on read order.
Every row of a component gets a `duplicates` row (a row confirmed with no better keeper is a
group of one, kept), so a later run can recompute the component whole.

At a billion rows the grouping is layers of Ray tasks (prx_core.stages.duplicates.runs), committed
once. The asset re-runs after every source's `phashes`, so a run recomputes only the components the
changed sources touch (which sources changed: prx_core.stages.duplicates.state). Without a state,
after someone else changed the table, or when the changed sources hold more than `full_fraction`
of the rows, it recomputes every group. The driver holds object references and one summary per
work unit, never rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lance import LanceDataset

from prx_core.compute import wire
from prx_core.compute.groupby import BUCKET_ROWS
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import UnitResults
from prx_core.stages.duplicates.check import KeeperCheck, check_keepers
from prx_core.stages.duplicates.groups import find_duplicates, keeper_order
from prx_core.stages.duplicates.runs import (
    commit_all,
    commit_changed,
    plan_all,
    plan_changed,
    reduce_all,
    reduce_changed,
)
from prx_core.stages.duplicates.state import (
    Layout,
    State,
    changed_sources,
    load_state,
    read_layout,
    save_state,
    untouched_since,
)
from prx_core.stages.report import ReportSummary, StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_columns, index_table

CODE_VERSION = "3"  # part of the state: another version recomputes everything (3: near-duplicates)
KEYS, PHASH = "keys", "phash"  # the rules: match keys confirmed by signatures (default), or the seed's identical pHash
UNIT_ROWS = 1_000_000  # rows per map unit (keys, pHash and signature: ~450 bytes a row)
# Changed sources holding more of the rows than this: a full recompute is cheaper (measured at 4M
# rows on 2 cores: ~2-3 us per row for a full run, 15-30 us per affected hash incrementally).
FULL_FRACTION = 0.1
SAMPLE_ROWS = 30  # rows of the committed groups the report carries for the UI
__all__ = ["DUPLICATES", "DuplicatesReport", "GroupsReport", "build_duplicates", "find_duplicates", "keeper_order"]


@dataclass
class DuplicatesReport(StageReport):
    """What a run did (`mode`, what it read and wrote) and the table it left (`groups`, `duplicates`)."""

    ROWS = "rows_read"
    READ = {"phashes": "phashes_version"}
    WRITTEN = {"duplicates": "duplicates_version"}

    rows_read: int  # phashes rows the map tasks read: all (full) or the changed sources' (incremental)
    groups: int  # groups of two or more in the table after the run
    duplicates: int  # samples that lose to a keeper, in the table after the run
    phashes_version: int
    duplicates_version: int
    mode: str = "full"  # "full", "incremental" or "unchanged" (nothing committed)
    reason: str = ""  # why a full recompute
    changed_sources: list[str] = field(default_factory=list)
    phashes_rows: int = 0  # rows of the pinned phashes version
    affected_components: int = 0  # incremental: stored components recomputed
    member_rows: int = 0  # rows regrouped: every row of a component (full), of the affected ones (incremental)
    previous_rows_read: int = 0  # incremental: the changed sources' rows in the previous table
    candidate_pairs: int = 0  # pairs sharing a match key (copy classes chained)
    confirmed_pairs: int = 0  # of those, confirmed by their signatures
    skipped_keys: int = 0  # copy classes of over-common keys with more compatible neighbours than the window
    rounds: int = 0  # connected-components rounds
    rows_written: int = 0
    rows_deleted: int = 0  # incremental: previous rows of the recomputed groups
    buckets: int = 0
    map_units: int = 0
    fragments_counted: int = 0  # phashes fragments whose sources were read (new or changed ones)
    units: UnitResults | None = None  # the reduce phase
    previous_duplicates_version: int | None = None

    @property
    def duplicate_rate(self) -> float:
        return self.duplicates / max(self.phashes_rows or self.rows_read, 1)


def pin_duplicates(run: StageRun[DuplicatesSettings]) -> dict[str, Any]:
    """Which sources changed since the state, and so which way this run goes (`run.state["mode"]`):
    "unchanged" (no unit, no commit), "full" or "incremental", each planned with its inputs."""
    storage, options = run.storage, run.storage.lance_storage_options()
    phashes_uri = storage.lance_uri("phashes")
    phashes = run.state["phashes"] = lance_io.open_table(phashes_uri, options)
    if phashes is None:
        raise RuntimeError("the phashes table does not exist yet: materialize `phashes` first")
    table = run.state["table"] = lance_io.open_table(storage.lance_uri("duplicates"), options)
    state = load_state(storage, _state_version(run.settings.rule))
    layout, counted = read_layout(phashes, phashes_uri, options, state.layout if state else None)
    changed = changed_sources(state.layout, layout) if state else sorted(layout.sources())
    run.state.update(layout=layout, counted=counted)
    run.state["report"] = DuplicatesReport(0, 0, 0, phashes.version, table.version if table else 0,
                                           changed_sources=changed, phashes_rows=layout.rows(),
                                           fragments_counted=counted,
                                           previous_duplicates_version=table.version if table else None)
    reason = "asked" if run.settings.full else _full_reason(state, table, layout, changed, run.settings.full_fraction)
    run.state["report"].reason = reason
    if not reason and not changed:
        run.state["mode"] = "unchanged"
        run.params["mode"] = "unchanged"
        return {"phashes": phashes.version, "duplicates": table.version}
    run.state["mode"] = "full" if reason else "incremental"
    return plan_all(run, phashes) if reason else plan_changed(run, phashes, table, layout, changed)


def regroup(run: StageRun[DuplicatesSettings]) -> None:
    if run.state["mode"] == "full":
        reduce_all(run)
    elif run.state["mode"] == "incremental":
        reduce_changed(run)


def commit_duplicates(run: StageRun[DuplicatesSettings]) -> dict[str, int]:
    """The one commit of the new groups, the table's indexes caught up, then the state; unchanged:
    no commit (the state remembers fragments rewritten without changing any source's rows)."""
    storage, options, uri = run.storage, run.storage.lance_storage_options(), run.storage.lance_uri("duplicates")
    report, table, mode = run.state["report"], run.state["table"], run.state["mode"]
    phashes, layout = run.state["phashes"], run.state["layout"]
    if mode == "unchanged":
        report.mode = "unchanged"
        report.groups, report.duplicates = _totals(table)
        if run.state["counted"]:
            save_state(storage, State(phashes.version, table.version, report.groups + report.duplicates, layout,
                                      _state_version(run.settings.rule)))
        return {"duplicates": table.version}
    for name, value in (commit_all(run) if mode == "full" else commit_changed(run)).items():
        setattr(report, name, value)
    index_table(uri, "duplicates", options)  # on a worker: 20-40 GB of index delta at 1B rows
    # the changed sources' previous rows are found by `source`: a BITMAP index makes it a lookup
    version = index_columns(uri, options, bitmap_columns=["source"], merge_rows=0).version
    report.duplicates_version = version
    report.groups, report.duplicates = _totals(lance_io.require_table(uri, options).checkout_version(version))
    save_state(storage, State(phashes.version, version, report.groups + report.duplicates, layout,
                              _state_version(run.settings.rule)))
    return {"duplicates": version}


def report_duplicates(run: StageRun[DuplicatesSettings]) -> DuplicatesReport:
    return run.state["report"]


@dataclass
class GroupsReport:
    """`duplicates`: the run, its keeper check, and a few rows of the groups for the UI."""

    duplicates: DuplicatesReport
    check: KeeperCheck
    sample: list[dict[str, Any]]

    def summary(self) -> ReportSummary:
        return self.duplicates.summary()


def check_groups(report: DuplicatesReport, run: StageRun[DuplicatesSettings]) -> GroupsReport:
    """`then` of `duplicates`, under its lock after the commit: the keeper check of the version it
    committed (of the groups it changed, when it could: `check`), on workers, and
    `sample_rows` rows of it for the UI."""
    storage = run.storage
    check = check_keepers(storage, report, run.settings.unit_rows, run.settings.rows_per_bucket)
    table = lance_io.open_table(storage.lance_uri("duplicates"), storage.lance_storage_options())
    sample = [] if table is None else table.checkout_version(report.duplicates_version).to_table(
        columns=["group_id", "sample_id", "source", "keeper", "pixels"], limit=run.settings.sample_rows).to_pylist()
    return GroupsReport(report, check, sample)


@dataclass(frozen=True, kw_only=True)
class DuplicatesSettings(Settings):
    """The `duplicates` settings: unit sizes, when to regroup everything, the matching rule, and the
    rows of groups the report samples."""

    unit_rows: int = UNIT_ROWS
    rows_per_bucket: int = BUCKET_ROWS
    full: bool = False
    full_fraction: float = FULL_FRACTION
    rule: str = KEYS
    sample_rows: int = SAMPLE_ROWS


DUPLICATES: Stage[DuplicatesSettings] = Stage(
    "duplicates", reads=("phashes",), writes=("duplicates",), after=("phashes",),
    code_version=CODE_VERSION, report_type=GroupsReport,
    settings=DuplicatesSettings,
    unit_sizes=(UnitSize("unit_rows", "Rows per `duplicates` map task (six small columns)."),
                UnitSize("rows_per_bucket", "Rows per `duplicates` reduce unit (the manifest pins the bucket count).")),
    # the manifest pins what they decide (mode and buckets); sample_rows only shapes the report (`then`)
    unpinned=("rows_per_bucket", "full", "full_fraction", "sample_rows"),
    phases=("reduce", "delete"), partition="corpus",
    pin=pin_duplicates, work=regroup, commit=commit_duplicates, report=report_duplicates, then=check_groups,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(GroupsReport, DuplicatesReport, KeeperCheck)
# their names before this module and the check's moved into the duplicates package
wire.register_moved_from("prx_core.stages.duplicates", GroupsReport, DuplicatesReport)
wire.register_moved_from("prx_core.stages.duplicates_check", KeeperCheck)


def build_duplicates(storage: Storage, progress: Throttle | None = None, unit_rows: int = UNIT_ROWS,
                     rows_per_bucket: int = BUCKET_ROWS, full: bool = False,
                     full_fraction: float = FULL_FRACTION, rule: str = KEYS) -> DuplicatesReport:
    """Bring `duplicates` up to the latest `phashes` in one commit (none when nothing changed):
    `run_partition` of DUPLICATES, under the one lock of the corpus, then its keeper check. `rule`
    "phash" groups identical pHashes without confirmation (the first release's rule, for
    comparison). Returns the run's part of the report (the whole `GroupsReport`, the check's
    result with it: `run_partition(DUPLICATES, ...)`)."""
    return run_partition(DUPLICATES, storage, progress=progress, unit_rows=unit_rows, rows_per_bucket=rows_per_bucket,
                         full=full, full_fraction=full_fraction, rule=rule).duplicates


def _state_version(rule: str) -> str:
    """The state's code version: the code's, and the rule when it is not the default (another rule
    recomputes every group)."""
    if rule not in (KEYS, PHASH):
        raise ValueError(f"duplicates rule {rule!r}: use {KEYS!r} (match keys confirmed by signatures) or {PHASH!r}")
    return CODE_VERSION if rule == KEYS else f"{CODE_VERSION}-{rule}"


def _full_reason(state: State | None, table: LanceDataset | None, layout: Layout, changed: list[str],
                 fraction: float) -> str:
    """Why this run must recompute every group; "" when the changed sources' groups suffice."""
    if state is None:
        return "no state"
    if table is None:
        return "no duplicates table"
    if not untouched_since(table, state.duplicates_version, state.duplicates_rows):
        return f"duplicates changed since version {state.duplicates_version}"
    if layout.rows(changed) > fraction * layout.rows() or state.layout.rows(changed) > fraction * state.layout.rows():
        return f"the changed sources hold more than {fraction:.0%} of the rows"
    return ""


def _totals(table: LanceDataset | None) -> tuple[int, int]:
    """(groups of two or more, losers) of the whole table: counted by Lance, no row reaches Python."""
    if table is None:
        return 0, 0
    return table.count_rows(filter="keeper AND group_size >= 2"), table.count_rows(filter="NOT keeper")
