"""The fence every commit passes: `ensure_held()` fails a writer whose partition lock was lost.

A stage takes its partition locks (`prx_core.store.locks`) in the thread that later commits; the
locks it holds live in a context variable, so the commit primitives (`lance_io.replace_rows`,
`storage.put_atomic`, the batched appends' deletes) check them without stage code passing locks
around. Outside any lock (compaction, tests of a single table) the check does nothing.
This module imports nothing of prx_core: the lowest storage layers can call it.
"""

from __future__ import annotations

import contextvars
from typing import Protocol


class Fence(Protocol):
    def ensure_held(self) -> None: ...


_HELD: contextvars.ContextVar[tuple[Fence, ...]] = contextvars.ContextVar("prx_held_locks", default=())


def ensure_held() -> None:
    """Raise (`locks.LockLost`) unless every lock this context holds is still ours; call it right
    before a commit."""
    for lock in _HELD.get():
        lock.ensure_held()


def hold(lock: Fence) -> None:
    _HELD.set((*_HELD.get(), lock))


def drop(lock: Fence) -> None:
    _HELD.set(tuple(held for held in _HELD.get() if held is not lock))


def held() -> tuple[Fence, ...]:
    return _HELD.get()
