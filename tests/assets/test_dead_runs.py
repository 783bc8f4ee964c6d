"""A killed build never blocks the next (issue 44, item 1), on the stand-in assets with a `captions`
in the `gpu` pool and a real on-disk instance configured by the repo's dagster.yaml (one slot):
a build SIGKILLed inside `captions` leaves its run STARTED holding the slot; the next `run_build`
marks it failed and frees the slot before it starts, and a build waiting on a live holder names
it, then goes on by itself once that holder is killed. (The same through `prx-corpus build` on a
real corpus: tests/e2e/test_build.py, SIGKILL inside `captions`.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dead_run_child import assets

from prx_cli import dead_runs
from prx_cli.build import run_build
from prx_assets.settings import REPO

CHILD = Path(__file__).with_name("dead_run_child.py")
MARKER = "PRX-PAUSED-AT captions"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    folder = tmp_path / "dh"
    folder.mkdir()
    shutil.copy(REPO / "dagster.yaml", folder / "dagster.yaml")  # the gpu pool: default_limit 1, granularity op
    instance = dg.DagsterInstance.from_config(str(folder))
    instance.add_dynamic_partitions("sources", ["photos"])
    instance.dispose()
    return folder


@pytest.fixture
def holder(home: Path, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A build paused inside `captions`, holding the gpu pool's slot; killed at the end whatever happens."""
    err = open(tmp_path / "child.err", "w")
    child = subprocess.Popen([sys.executable, str(CHILD), str(home)], stdout=err, stderr=err, start_new_session=True,
                             env={**os.environ, "PRX_PAUSE_AT": "captions"})
    deadline = time.monotonic() + 120
    while MARKER not in (tmp_path / "child.err").read_text():
        assert child.poll() is None and time.monotonic() < deadline, (tmp_path / "child.err").read_text()[-3000:]
        time.sleep(0.2)
    yield child
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    err.close()


def kill(child: subprocess.Popen) -> None:
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)


def slot_holders(instance: dg.DagsterInstance) -> list[str]:
    return [c.run_id for c in instance.event_log_storage.get_concurrency_info("gpu").claimed_slots]


def build_in_thread(instance: dg.DagsterInstance, log: list[str]) -> tuple[threading.Thread, dict]:
    """`run_build` of `captions` (no pause) in a thread: a hang is a join timeout, not a stuck test."""
    done: dict = {}

    def target() -> None:
        done["outcome"] = run_build(dg.Definitions(assets=assets(pause=False)), instance, ["photos"], None,
                                    ["captions"], echo=lambda *a, **k: log.append(" ".join(map(str, a))))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, done


def test_a_build_killed_inside_captions_is_failed_and_its_slot_freed_by_the_next(home: Path, holder) -> None:
    instance = dg.DagsterInstance.from_config(str(home))
    [dead] = slot_holders(instance)
    kill(holder)
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.STARTED  # nothing else ends it

    log: list[str] = []
    thread, done = build_in_thread(instance, log)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the rerun waits for the dead run's pool slot:\n" + "\n".join(log)
    assert done["outcome"].ok, log
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.FAILURE
    [reconciled] = [i for i, line in enumerate(log)
                    if line.startswith(f"reconciled: run {dead[:8]} (build_source [photos]) was left STARTED")]
    assert reconciled < log.index("==> captions [photos]"), log  # before its first run: never a wait
    assert not any("waiting" in line for line in log), log
    assert any(f"pool slots and queued steps of run {dead[:8]} (FAILURE)" in line for line in log), log
    assert slot_holders(instance) == []
    instance.dispose()


def test_a_build_waiting_for_a_live_holder_names_it_and_goes_on_when_it_dies(
        home: Path, holder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dead_runs, "WAIT_REPORT_SECONDS", 0.5)
    instance = dg.DagsterInstance.from_config(str(home))
    [live] = slot_holders(instance)
    log: list[str] = []
    thread, done = build_in_thread(instance, log)
    deadline = time.monotonic() + 60
    needle = f"held by run {live[:8]} (build_source [photos], step captions, STARTED, pid {holder.pid} on this host, alive)"
    while not any(needle in line for line in log):
        assert time.monotonic() < deadline, "no line names the live holder:\n" + "\n".join(log)
        time.sleep(0.2)
    assert instance.get_run_by_id(live).status == dg.DagsterRunStatus.STARTED  # alive: never judged
    assert any("captions: waiting" in line and "for a slot of pool 'gpu' (limit 1)" in line for line in log), log

    kill(holder)  # the holder dies while the build waits: the next report frees its slot
    thread.join(timeout=300)  # then the build runs captions and what follows: ~1 min, several on a loaded machine
    assert not thread.is_alive(), "the build still waits after its holder died:\n" + "\n".join(log)
    assert done["outcome"].ok, log
    assert instance.get_run_by_id(live).status == dg.DagsterRunStatus.FAILURE
    instance.dispose()
