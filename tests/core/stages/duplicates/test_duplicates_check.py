"""The `duplicates_one_keeper` check after an incremental run reads the groups that run wrote,
not the table (hazard 6: at 1B rows the whole-table check reshuffled a billion rows after every
source's run), and still sees a bad group whose rows lie outside the new fragments; it falls back
to every group whenever the version it starts from is not on record as passed."""

from __future__ import annotations

import json

import pytest
from lance import LanceDataset, LanceOperation
from dup_rows import write_source
from test_duplicates_stage import SMALL_CHANGE, storage  # noqa: F401 (storage: a fixture)

from prx_core.stages.duplicates.stage import DUPLICATES, build_duplicates
from prx_core.stages.duplicates.check import RECORD, check_changed_groups, check_keepers, load_record
from prx_core.stages.stage import run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


def new_groups(storage: Storage, version: int, start: int) -> set[str]:
    """Group ids of the fragments `version` has and `start` had not."""
    table = lance_io.require_table(storage.lance_uri("duplicates")).checkout_version(version)
    before = {f.fragment_id for f in table.checkout_version(start).get_fragments()}
    return {g for f in table.get_fragments() if f.fragment_id not in before
            for g in f.to_table(columns=["group_id"])["group_id"].to_pylist()}


def test_after_an_incremental_run_only_the_changed_groups_are_checked(storage: Storage) -> None:
    """The check is the stage's own last step (`then`): each run's report carries it."""
    grouped = run_partition(DUPLICATES, storage, rows_per_bucket=80)
    full, first = grouped.duplicates, grouped.check
    total = lance_io.require_table(storage.lance_uri("duplicates")).count_rows()
    assert (first.scope, first.passed, first.rows) == ("all", True, total)
    assert load_record(storage) == {"version": full.duplicates_version, "rows": total, "passed": True}

    write_source(storage, "d", [("1", 13, 1, 2, 90, 1), ("2", 3, 3, 999, 90, 1), ("3", 40, 0, 1, 90, 1)], fragments=1)
    grouped = run_partition(DUPLICATES, storage, unit_rows=2, rows_per_bucket=20, full_fraction=SMALL_CHANGE)
    report, check = grouped.duplicates, grouped.check
    assert report.mode == "incremental"
    changed = new_groups(storage, report.duplicates_version, report.previous_duplicates_version)
    table = lance_io.require_table(storage.lance_uri("duplicates"))
    want = table.count_rows(filter=f"group_id IN ({', '.join(repr(g) for g in sorted(changed))})")
    assert (check.scope, check.passed, check.groups, check.rows) == ("changed", True, len(changed), want)
    assert 0 < check.rows < table.count_rows()  # the changed groups whole, not the table

    again = build_duplicates(storage, rows_per_bucket=20)
    assert again.mode == "unchanged"
    assert check_keepers(storage, again).scope == "unchanged"


def test_the_changed_check_sees_rows_outside_the_new_fragments(storage: Storage) -> None:
    """A new group written while the group's previous rows stayed (a delete that went wrong): the
    lookup by group id brings the old rows, and the group has two keepers."""
    full = build_duplicates(storage, rows_per_bucket=80)
    uri = storage.lance_uri("duplicates")
    table = lance_io.require_table(uri)
    old = table.to_table(filter="keeper AND group_size >= 2", limit=1).to_pylist()[0]
    planted = [{**old, "sample_id": "z/copy", "source": "z", "keeper": True, "keeper_sample_id": "z/copy"}]
    fragments = lance_io.write_fragments(uri, schemas.DUPLICATES.empty_table().from_pylist(planted, schemas.DUPLICATES),
                                         schemas.DUPLICATES)
    version = LanceDataset.commit(uri, LanceOperation.Append(fragments), read_version=table.version).version
    check = check_changed_groups(storage, version, full.duplicates_version, rows_per_bucket=2)
    assert (check.scope, check.groups, check.bad_groups, check.examples) == ("changed", 1, 1, [old["group_id"]])
    assert check.rows == old["group_size"] + 1


@pytest.mark.parametrize("record", ["missing", "failed", "older"])
def test_every_group_is_checked_unless_the_start_passed(storage: Storage, record: str) -> None:
    full = build_duplicates(storage, rows_per_bucket=80)
    check_keepers(storage, full)
    path = storage.uri(*RECORD)
    fs = storage.filesystem()
    if record == "missing":
        fs.rm(path)
    elif record == "failed":
        fs.pipe(path, json.dumps({**json.loads(fs.cat_file(path)), "passed": False}).encode())
    else:  # a run whose check never ran (killed): its Update lies between the record and the next start
        write_source(storage, "e", [("1", 3, 4, 5, 90, 1)], fragments=1)
        assert build_duplicates(storage, rows_per_bucket=20, full_fraction=SMALL_CHANGE).mode == "incremental"
    write_source(storage, "d", [("1", 13, 1, 2, 90, 1)], fragments=1)
    report = build_duplicates(storage, rows_per_bucket=20, full_fraction=SMALL_CHANGE)
    assert report.mode == "incremental"
    check = check_keepers(storage, report)
    assert (check.scope, check.passed) == ("all", True)
    assert check.rows == lance_io.require_table(storage.lance_uri("duplicates")).count_rows()
    assert load_record(storage)["version"] == report.duplicates_version
