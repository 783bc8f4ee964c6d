"""Model actors outlive their run (prx_core.compute.actors): the next run of the same shape reuses
the process, building only the model it brings; the idle pool gives way to other shapes, stays
within half the cluster's CPUs, and forgets actors idle too long or stopped early."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from prx_core.compute import actors
from prx_core.compute.actors import IDLE, imap_actors, release_idle
from prx_core.compute.parallel import TaskFailed

pytestmark = pytest.mark.usefixtures("ray_cluster")
HALF = 0.5  # the core tests' Ray has one CPU: an actor of half a CPU is the most the pool keeps


class Counted:
    """A model that leaves one file in `builds` per build (actors are other processes)."""

    def __init__(self, name: str, builds: str) -> None:
        self.name = name
        Path(builds, f"{name}-{os.getpid()}-{time.monotonic_ns()}").touch()

    def __call__(self, x: int) -> str:
        if x < 0:
            raise ValueError("negative input")
        return f"{self.name}:{x}"


def on_actor(host: actors.ModelHost, x: int) -> tuple[int, str]:
    return os.getpid(), host.run(x)[0]


def run(factory, xs: list[int], **options) -> dict[int, tuple[int, str]]:
    return dict(imap_actors(factory, on_actor, [(x,) for x in xs], **{"num_cpus": HALF, **options}))


def builds(folder: Path, name: str) -> int:
    return sum(1 for p in folder.iterdir() if p.name.startswith(f"{name}-"))


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    release_idle()
    yield tmp_path
    release_idle()


def test_the_next_run_reuses_the_process_and_builds_only_its_own_model(folder: Path) -> None:
    first = run(partial(Counted, "labels", str(folder)), [1, 2, 3])
    assert {out for _, out in first.values()} == {"labels:1", "labels:2", "labels:3"} and len(IDLE) == 1
    second = run(partial(Counted, "embed", str(folder)), [4, 5])
    assert {pid for pid, _ in second.values()} == {pid for pid, _ in first.values()}  # one process for both runs
    assert {out for _, out in second.values()} == {"embed:4", "embed:5"}
    assert (builds(folder, "labels"), builds(folder, "embed")) == (1, 1)
    run(partial(Counted, "labels", str(folder)), [6])  # one model at a time: the first is built again
    assert builds(folder, "labels") == 2


def test_the_same_factory_twice_builds_once(folder: Path) -> None:
    run(partial(Counted, "same", str(folder)), [1])
    run(partial(Counted, "same", str(folder)), [2])
    assert builds(folder, "same") == 1


def test_an_actor_of_another_shape_stays_while_the_new_ones_fit_beside_it(folder: Path) -> None:
    first = run(partial(Counted, "a", str(folder)), [1])
    run(partial(Counted, "b", str(folder)), [2], num_cpus=0.25)  # fits beside it; then more than half: not kept
    assert len(IDLE) == 1
    again = run(partial(Counted, "a", str(folder)), [3])
    assert {pid for pid, _ in again.values()} == {pid for pid, _ in first.values()} and builds(folder, "a") == 1


def test_an_actor_of_another_shape_is_ended_when_the_new_ones_need_its_cpus(folder: Path) -> None:
    import ray

    run(partial(Counted, "a", str(folder)), [1])
    [old] = IDLE.take(actors.Shape(HALF, 0.0, ""), 1)
    IDLE.give_back(actors.Shape(HALF, 0.0, ""), [old])
    run(partial(Counted, "b", str(folder)), [2], num_cpus=0.75)  # half a CPU is free: the idle one must go
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.call.remote("k", None, on_actor, 1), timeout=60)
    assert len(IDLE) == 0  # three quarters of a CPU is more than the pool keeps


def test_the_pool_keeps_at_most_half_the_cpus(folder: Path) -> None:
    run(partial(Counted, "two", str(folder)), list(range(8)), actors=2, num_cpus=0.4)
    assert len(IDLE) == 1  # 0.8 of one CPU would leave a task too little


def test_a_run_that_failed_keeps_no_actor(folder: Path) -> None:
    with pytest.raises(TaskFailed, match="negative input"):
        run(partial(Counted, "bad", str(folder)), [1, -1, 2, 3], max_retries=0)
    assert len(IDLE) == 0


def test_an_actor_idle_too_long_is_ended(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = run(partial(Counted, "old", str(folder)), [1])
    monkeypatch.setattr(actors, "IDLE_SECONDS", 0.0)
    second = run(partial(Counted, "old", str(folder)), [2])
    assert {pid for pid, _ in second.values()} != {pid for pid, _ in first.values()}
    assert builds(folder, "old") == 2


def test_with_no_idle_time_no_actor_outlives_its_run(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(actors, "IDLE_SECONDS", 0.0)  # PRX_IDLE_ACTOR_SECONDS=0
    run(partial(Counted, "once", str(folder)), [1])
    assert len(IDLE) == 0
