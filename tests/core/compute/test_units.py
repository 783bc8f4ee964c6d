"""Work units and checkpoints (prx_core.compute.units) on a real local Ray and a real corpus root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prx_core.compute.parallel import Throttle
from prx_core.compute.units import Manifest, Unit, UnitFailed, UnitRun, run_units
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


def write_unit(unit: Unit, run: UnitRun) -> dict:
    """Writes one output file per unit, fails where the spec says so."""
    if unit.spec.get("fail"):
        raise ValueError(f"planted failure in {unit.id}")
    out = run.scratch_uri(f"{unit.id}.txt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    Path(out).write_text(unit.spec["text"])
    orphan = os.path.join(run.storage.root, "outputs", f"{run.token}-{unit.id}")
    os.makedirs(orphan, exist_ok=True)
    return {"rows": unit.rows, "outputs": [orphan], "text": unit.spec["text"]}


def units(n: int, fail: set[int] = frozenset()) -> list[Unit]:
    return [Unit(f"u{i:03d}", 10 + i, {"text": f"unit {i}", "fail": i in fail}) for i in range(n)]


def manifest(version: int = 1) -> Manifest:
    return Manifest("buckets", "photos_a", {"samples": version}, "1")


def test_every_unit_runs_once_and_is_recorded(tmp_path: Path) -> None:
    run = UnitRun.open(Storage(str(tmp_path)), manifest())
    lines: list[str] = []
    result = run_units(run, units(5), write_unit, progress=Throttle(lines.append, "buckets[photos_a]", seconds=0))
    assert (result.ran, result.skipped, result.units) == (5, 0, 5)
    assert [s["unit"] for s in result.summaries] == [f"u{i:03d}" for i in range(5)]  # plan order
    assert result.total("rows") == sum(10 + i for i in range(5))
    assert result.worker_peak_rss_mb() > 0 and len(result.nodes()) == 1
    assert sorted(run.completed()) == [f"u{i:03d}" for i in range(5)]
    assert lines[-1].startswith("buckets[photos_a]: 5/5 units, 60/60 rows")
    assert "ETA" in lines[0] and "ETA" not in lines[-1]


def test_a_rerun_of_the_same_manifest_skips_recorded_units(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    run = UnitRun.open(storage, manifest())
    with pytest.raises(UnitFailed, match=r"unit u002 failed after 0 retries: ValueError: planted failure"):
        run_units(run, units(4, fail={2}), write_unit, max_retries=0, max_in_flight=1)
    recorded = set(run.completed())
    assert recorded >= {"u000", "u001"} and "u002" not in recorded
    again = UnitRun.open(storage, manifest())
    assert again.token == run.token  # the same attempt: its output names stay valid
    lines: list[str] = []
    result = run_units(again, units(4), write_unit, progress=Throttle(lines.append, "b", seconds=0))
    assert result.skipped == len(recorded) and result.ran == 4 - len(recorded)
    assert lines[0] == f"b: resuming, {len(recorded)} units already done ({sum(10 + int(u[1:]) for u in recorded)} rows)"
    assert [s["text"] for s in result.summaries] == [f"unit {i}" for i in range(4)]


def test_another_manifest_discards_the_old_attempt_and_its_outputs(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    old = UnitRun.open(storage, manifest(1))
    run_units(old, units(2), write_unit)
    orphans = [o for s in old.completed().values() for o in s["outputs"]]
    assert all(os.path.isdir(o) for o in orphans)
    new = UnitRun.open(storage, manifest(2))
    assert new.token != old.token
    assert not any(os.path.exists(o) for o in orphans)  # uncommitted outputs of the old attempt
    assert not os.path.exists(old.uri) and new.completed() == {}


def test_finish_forgets_the_attempt_but_keeps_its_outputs(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    run = UnitRun.open(storage, manifest())
    result = run_units(run, units(2), write_unit)
    run.finish()
    assert not os.path.exists(run.uri)
    assert all(os.path.isdir(o) for s in result.summaries for o in s["outputs"])
    fresh = UnitRun.open(storage, manifest())  # a later rerun starts over, with new output names
    assert fresh.token != run.token and fresh.completed() == {}


def test_committed_attempt_left_behind_keeps_its_outputs(tmp_path: Path) -> None:
    """A crash between the commit marker and the folder removal: the outputs are live."""
    storage = Storage(str(tmp_path))
    run = UnitRun.open(storage, manifest(1))
    result = run_units(run, units(1), write_unit)
    Path(run.uri, "committed").write_bytes(b"")
    UnitRun.open(storage, manifest(2))
    assert all(os.path.isdir(o) for s in result.summaries for o in s["outputs"])


def test_volatile_inputs_stay_out_of_the_identity_and_a_resume_keeps_the_versions_it_pinned(tmp_path: Path) -> None:
    """Another partition moved a shared table: the attempt resumes (same token, recorded units
    skipped) and reads on the versions it first pinned; what the partition reads of it changed
    (`reads`): another attempt. Without volatile inputs the digest is the one manifests always had."""
    storage = Storage(str(tmp_path))

    def shared(version: int, reads: str = "r1") -> Manifest:
        return Manifest("buckets", "photos_a", {"samples": 1, "captions": version, "reads": reads}, "1",
                        volatile=("captions",))

    assert manifest().digest() == "1c5f1875235a2924"  # as before volatile inputs: old attempts stay valid
    assert shared(4).digest() == shared(9).digest() != shared(4, "r2").digest()
    run = UnitRun.open(storage, shared(4))
    run_units(run, units(2), write_unit)
    again = UnitRun.open(storage, shared(9))
    assert again.token == run.token and again.manifest.inputs["captions"] == 4
    assert run_units(again, units(3), write_unit).skipped == 2
    other = UnitRun.open(storage, shared(9, "r2"))
    assert other.token != run.token and other.manifest.inputs["captions"] == 9


def test_a_discard_spares_the_outputs_a_reader_may_hold(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    old = UnitRun.open(storage, manifest(1))
    run_units(old, units(3), write_unit)
    orphans = sorted(o for s in old.completed().values() for o in s["outputs"])
    UnitRun.open(storage, manifest(2), spare=lambda uri: uri == orphans[1])
    assert [os.path.exists(o) for o in orphans] == [False, True, False]


@pytest.mark.parametrize("partition", ["..", "a/b", "", "A"])
def test_a_partition_that_is_not_a_source_name_is_refused(partition: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        Manifest("buckets", partition, {}, "1")


def test_record_is_atomic_json(tmp_path: Path) -> None:
    run = UnitRun.open(Storage(str(tmp_path)), manifest())
    run.record("u1", {"rows": 3})
    files = os.listdir(os.path.join(run.uri, "done"))
    assert files == ["u1.json"] and json.loads(Path(run.uri, "done", "u1.json").read_text()) == {"rows": 3}


def hang_or_fail(unit: Unit, run: UnitRun) -> dict:
    """Hangs (a stuck decoder, a worker Ray keeps restarting) or raises where the spec says so."""
    import time

    if unit.spec.get("hang"):
        time.sleep(3600)
    if unit.spec.get("fail"):
        raise ValueError(f"planted failure in {unit.id}")
    return {"rows": unit.rows}


def lost(unit: Unit, run: UnitRun, message: str) -> dict:
    return {"rows": 0, "lost": message}


def test_a_unit_past_its_time_limit_is_cancelled_and_recorded_as_failed(tmp_path: Path) -> None:
    import time

    run = UnitRun.open(Storage(str(tmp_path)), manifest())
    plan = [Unit("u000", 1, {}), Unit("u001", 1, {}), Unit("u002", 1, {"hang": True})]
    began = time.monotonic()
    result = run_units(run, plan, hang_or_fail, time_limit_s=5, on_failed=lost)
    assert time.monotonic() - began < 60
    assert result.failed() == ["u002"] and result.total("rows") == 2
    failed = result.summaries[2]
    assert "over the 5 s time limit" in failed["failed"] and failed["lost"] == failed["failed"]
    assert set(run.completed()) == {"u000", "u001", "u002"}  # a resume does not wait on it again


def test_a_unit_that_keeps_raising_is_recorded_and_the_rest_go_on(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    run = UnitRun.open(storage, manifest())
    result = run_units(run, units(4, fail={1}), hang_or_fail, max_retries=1, on_failed=lost)
    assert result.failed() == ["u001"] and result.ran == 4
    assert "failed after 1 retries: ValueError: planted failure in u001" in result.summaries[1]["failed"]
    again = run_units(UnitRun.open(storage, manifest()), units(4, fail={1}), hang_or_fail, on_failed=lost)
    assert again.skipped == 4 and again.failed() == ["u001"]


def test_without_a_handler_a_hung_unit_fails_the_run_naming_it(tmp_path: Path) -> None:
    run = UnitRun.open(Storage(str(tmp_path)), manifest())
    with pytest.raises(UnitFailed, match=r"unit u001 timed out: still running after \d+ s, over the 4 s time limit"):
        run_units(run, [Unit("u000", 1, {}), Unit("u001", 1, {"hang": True})], hang_or_fail, time_limit_s=4)


def read_file_unit(unit: Unit, run: UnitRun) -> dict:
    """Reads `spec["bytes"]` bytes of a file written before the run (page cache or not)."""
    with open(unit.spec["path"], "rb") as handle:
        assert len(handle.read(unit.spec["bytes"])) == unit.spec["bytes"]
    return {"rows": unit.rows}


def test_each_unit_records_the_bytes_it_read(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 << 20))
    plan = [Unit("small", 1, {"path": str(data), "bytes": 1 << 20}), Unit("large", 1, {"path": str(data), "bytes": 3 << 20})]
    result = run_units(UnitRun.open(Storage(str(tmp_path / "root")), manifest()), plan, read_file_unit)
    read = {s["unit"]: s["read_bytes"] for s in result.summaries}
    # its own reads, plus what recording a unit reads (a few KB), never another unit's
    assert 1 << 20 <= read["small"] < (1 << 20) + (512 << 10), read
    assert 3 << 20 <= read["large"] < (3 << 20) + (512 << 10), read
    assert result.total("read_bytes") == sum(read.values())
