"""Model work units on long-lived Ray actors: a model is loaded once per actor, not once per unit.

Each actor builds its model once (`factory()`), at its first use: a unit with nothing pending (a
rerun, a source already done) never loads it, and a model that cannot be built fails the unit with
its own error. Then it runs unit after unit. Two units are queued per actor and run in two threads,
while a lock lets only one of them use the model at a time: the next unit's lookups and image reads
overlap the current unit's model calls, so the model (the GPU) stays busy. The seconds
`ModelHost.run` returns are what the benchmark reports as the model's busy time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prx_core.compute.parallel import TaskFailed

UNITS_PER_ACTOR = 2  # one running on the model, one preparing its inputs


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
    def __init__(self, factory: Callable[[], Any]) -> None:
        self.host = ModelHost(factory)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.host, *args)


def imap_actors(factory: Callable[[], Any], fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]], *,
                actors: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0, max_retries: int = 2,
                runtime_env: dict[str, Any] | None = None) -> Iterator[tuple[int, Any]]:
    """`fn(host, *args)` for every args tuple of `calls` on `actors` actors that each hold
    `factory()`, yielding (call number, result) in completion order; the driver holds at most
    `UNITS_PER_ACTOR` calls per actor. A call that raises is retried `max_retries` times; an actor
    that dies is replaced and its calls resubmitted. Then the error is raised as `TaskFailed`."""
    import ray

    remote = ray.remote(_Actor).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=UNITS_PER_ACTOR,
                                        **({"runtime_env": runtime_env} if runtime_env else {}))
    if not num_gpus:  # actors beyond the cluster's CPUs would never start, and their calls never run
        actors = min(actors, max(1, int(ray.cluster_resources().get("CPU", 1) // max(num_cpus, 1e-9))))
    pool = [remote.remote(factory) for _ in range(max(1, actors))]
    load = [0] * len(pool)
    retry: deque[int] = deque()
    args_of: dict[int, tuple[Any, ...]] = {}
    attempts: dict[int, int] = {}
    pending: dict[Any, tuple[int, int, Any]] = {}  # ref -> (call number, actor index, actor)
    numbered = enumerate(calls)
    exhausted = False
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
                    pending[pool[index].call.remote(fn, *args_of[number])] = (number, index, pool[index])
                    load[index] += 1
            if not pending:
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
                    pool[index] = remote.remote(factory)
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
        for actor in pool:
            ray.kill(actor)
