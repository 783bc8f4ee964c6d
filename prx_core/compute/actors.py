"""Model work units on long-lived Ray actors: a model is loaded once per actor, not once per unit,
and an actor outlives its stage run, so the next run in this process reuses its process.

Each actor builds its model once (`factory()`), at its first use: a unit with nothing pending (a
rerun, a source already done) never loads it, and a model that cannot be built fails the unit with
its own error. Then it runs unit after unit. Two units are queued per actor and run in two threads,
while a lock lets only one of them use the model at a time: the next unit's lookups and image reads
overlap the current unit's model calls, so the model (the GPU) stays busy. The seconds
`ModelHost.run` returns are what the benchmark reports as the model's busy time.

When a run ends its actors wait in this process's `IDLE` pool instead of dying: the next stage run
with the same resources (the labeller after the captioner, the next source's captioner) takes them.
Starting an actor costs a worker process, its imports (torch) and the model; a GPU captioner kept
across the sources of a backfill keeps its GPU busy. An actor holds one model at a time (built
anew when the next run brings another factory; the process's own caches, such as MiniLM's, stay).
An idle actor keeps its CPU and GPU reservation, so the pool gives way: idle actors of another
shape end when a run's own actors would not fit beside them; the idle ones hold at most half the
cluster's CPUs (a task always finds a CPU: no deadlock; on a small machine the tasks between two
model stages run on fewer CPUs); `release_idle` ends them all before a Ray Data pipeline sizes
itself to the cluster; and an actor idle for `IDLE_SECONDS` ends.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prx_core.compute.parallel import TaskFailed

UNITS_PER_ACTOR = 2  # one running on the model, one preparing its inputs
# an idle actor older than this is ended at the pool's next use; 0: no actor outlives its run
IDLE_SECONDS = float(os.environ.get("PRX_IDLE_ACTOR_SECONDS", "300"))


class ModelHost:
    """What a unit function running on an actor gets: the actor's model, built on first use and used
    by one thread at a time."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._model: Any = None
        self._lock = threading.Lock()

    def run(self, *args: Any) -> tuple[Any, float]:
        """`model(*args)` under the actor's lock; returns the result and the seconds the model worked
        (its loading not included)."""
        with self._lock:
            model = self._built()
            start = time.monotonic()
            result = model(*args)
            return result, time.monotonic() - start

    def _built(self) -> Any:
        if self._model is None:
            self._model = self._factory()
        return self._model


class _Actor:
    """One model at a time, keyed by its factory: a run with another factory drops the last model
    (and the GPU memory it held) before building its own."""

    def __init__(self) -> None:
        self._key = ""
        self._host: ModelHost | None = None
        self._switch = threading.Lock()

    def call(self, key: str, factory: Callable[[], Any], fn: Callable[..., Any], *args: Any) -> Any:
        with self._switch:
            if key != self._key:
                self._host, self._key = None, ""  # the last model's memory is freed before the next is built
                _free_memory()
                self._host, self._key = ModelHost(factory), key
            host = self._host
        return fn(host, *args)


def _free_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Shape:
    """What an actor reserves and runs in; only an actor of the same shape is reused."""

    num_cpus: float
    num_gpus: float
    runtime_env: str  # canonical JSON, "" for none


class IdleActors:
    """The actors finished runs of this process left, by shape, oldest first. A new Ray session
    (`ray.shutdown`, `ray.init`) drops them: their handles belong to the old one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[Shape, Any, float]] = []
        self._session = ""

    def take(self, shape: Shape, count: int) -> list[Any]:
        """Up to `count` idle actors of `shape`. Idle actors of other shapes stay while the actors
        still to start fit beside them (a GPU captioner waits through the CPU labeller for the next
        source); otherwise they end, those holding the missing resource first, oldest first."""
        import ray

        with self._lock:
            self._expire()
            picked = [i for i, entry in enumerate(self._idle) if entry[0] == shape][-count:]  # the newest
            taken = [self._idle[i] for i in picked]
            self._idle = [entry for i, entry in enumerate(self._idle) if i not in picked]
            missing = count - len(taken)
            if missing and self._idle:
                free = ray.available_resources()
                cpus, gpus = free.get("CPU", 0.0), free.get("GPU", 0.0)
                short_of_gpus = gpus < missing * shape.num_gpus
                for entry in sorted(self._idle, key=lambda e: ((e[0].num_gpus > 0) != short_of_gpus, e[2])):
                    if cpus >= missing * shape.num_cpus and gpus >= missing * shape.num_gpus:
                        break
                    self._idle.remove(entry)
                    _kill([entry[1]])
                    cpus, gpus = cpus + entry[0].num_cpus, gpus + entry[0].num_gpus
            return [actor for _, actor, _ in taken]

    def give_back(self, shape: Shape, actors: list[Any]) -> None:
        """Keep `actors` idle while all idle actors reserve at most half the cluster's CPUs; end the
        rest (all of them with PRX_IDLE_ACTOR_SECONDS=0)."""
        import ray

        with self._lock:
            self._expire()
            kept = sum(s.num_cpus for s, _, _ in self._idle)
            budget = ray.cluster_resources().get("CPU", 0) / 2 - kept if IDLE_SECONDS > 0 else -1.0
            now = time.monotonic()
            for actor in actors:
                if shape.num_cpus <= budget:
                    self._idle.append((shape, actor, now))
                    budget -= shape.num_cpus
                else:
                    _kill([actor])

    def clear(self) -> None:
        with self._lock:
            _kill(actor for _, actor, _ in self._idle)
            self._idle = []

    def __len__(self) -> int:
        return len(self._idle)

    def _expire(self) -> None:
        """Forget another session's actors; end those idle for longer than IDLE_SECONDS."""
        import ray

        session = ray.get_runtime_context().get_session_name() if ray.is_initialized() else ""
        if session != self._session:
            self._idle, self._session = [], session
        cutoff = time.monotonic() - IDLE_SECONDS
        _kill(actor for _, actor, since in self._idle if since < cutoff)
        self._idle = [entry for entry in self._idle if entry[2] >= cutoff]


IDLE = IdleActors()


def release_idle() -> None:
    """End every idle actor: before work that sizes itself to the cluster's free resources (a Ray
    Data pipeline of vLLM engines), which an idle actor's reservation would starve."""
    IDLE.clear()


def _kill(actors: Iterable[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone with its session or node: nothing to end
            pass


def factory_key(factory: Callable[[], Any]) -> str:
    """The factory's identity across runs: its pickled bytes (a `partial` of a class and its config)."""
    from ray import cloudpickle

    return hashlib.sha256(cloudpickle.dumps(factory)).hexdigest()


def imap_actors(factory: Callable[[], Any], fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]], *,
                actors: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0, max_retries: int = 2,
                runtime_env: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """`fn(host, *args)` for every args tuple of `calls` on `actors` actors that each hold
    `factory()`, yielding (call number, result) in completion order; the driver holds at most
    `UNITS_PER_ACTOR` calls per actor. A call that raises is retried `max_retries` times; an actor
    that dies is replaced and its calls resubmitted. Then the error is raised as `TaskFailed`.
    Actors come from, and after a clean end go back to, the idle pool (`IDLE`)."""
    import ray

    shape = Shape(num_cpus, num_gpus, json.dumps(runtime_env, sort_keys=True) if runtime_env else "")
    remote = ray.remote(_Actor).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=UNITS_PER_ACTOR,
                                        **({"runtime_env": runtime_env} if runtime_env else {}))
    count = max(1, actors)
    if not num_gpus:  # actors beyond the cluster's CPUs would never start, and their calls never run
        count = min(count, max(1, int(ray.cluster_resources().get("CPU", 1) // max(num_cpus, 1e-9))))
    key = factory_key(factory)
    pool = IDLE.take(shape, count)
    pool += [remote.remote() for _ in range(count - len(pool))]
    load = [0] * len(pool)
    retry: deque[int] = deque()
    args_of: dict[int, tuple[Any, ...]] = {}
    attempts: dict[int, int] = {}
    pending: dict[Any, tuple[int, int, Any]] = {}  # ref -> (call number, actor index, actor)
    numbered = enumerate(calls)
    exhausted = finished = False
    try:
        while True:
            for index in range(len(pool)):
                while load[index] < UNITS_PER_ACTOR:
                    if retry:
                        number = retry.popleft()
                    elif not exhausted and (item := next(numbered, None)) is not None:
                        number, args_of[item[0]] = item[0], item[1]
                    else:
                        exhausted = True
                        break
                    pending[pool[index].call.remote(key, factory, fn, *args_of[number])] = (number, index, pool[index])
                    load[index] += 1
            if not pending:
                finished = True
                return
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            number, index, actor = pending.pop(ready)
            load[index] -= 1
            try:
                result = ray.get(ready)
            except ray.exceptions.RayActorError:  # the actor died (OOM, node lost): replace it
                attempts[number] = attempts.get(number, 0) + 1
                if attempts[number] > max_retries:
                    raise TaskFailed(number, RuntimeError("the actor running it died")) from None
                if pool[index] is actor:  # its other calls fail too: replace it once
                    pool[index] = remote.remote()
                retry.append(number)
                continue
            except Exception as exc:
                attempts[number] = attempts.get(number, 0) + 1
                if attempts[number] > max_retries:
                    raise TaskFailed(number, getattr(exc, "cause", None) or exc) from exc
                retry.append(number)
                continue
            del args_of[number]
            yield number, result
    finally:
        # stopped early (a failure, an interrupt, a consumer that stopped reading): its actors may
        # still be busy, even when no call is pending at the moment it stopped
        if finished:
            IDLE.give_back(shape, pool)
        else:
            _kill(pool)
