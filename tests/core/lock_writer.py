"""A writer of the `photos` partition in its own process, for the lock race tests.

`python lock_writer.py CONFIG_JSON` reads commands on stdin (`acquire`, `commit LABEL`, `release`,
`exit`) and answers one line each on stdout. CONFIG holds the corpus root and storage options,
the lock's ttl, and the faults to simulate in this process: another PID namespace reporting a pid
dead here (`pid_ns`, `pid`), a wall clock off by `skew` seconds, a first heartbeat that waits for
the file `beat_gate` before writing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pyarrow as pa

from prx_core.store import locks, schemas
from prx_core.store.locks import LockLost, PartitionLock, PartitionLocked
from prx_core.store.partitions import reject_row, rejects_predicate, write_partition
from prx_core.store.storage import Storage


def simulate(config: dict[str, Any]) -> None:
    if config.get("skew"):
        real_time, skew = time.time, float(config["skew"])
        time.time = lambda: real_time() + skew  # type: ignore[assignment]
    if config.get("pid"):
        real_identity = locks.identity
        locks.identity = lambda: {**real_identity(), "pid": config["pid"],
                                  **({"pid_ns": config["pid_ns"]} if config.get("pid_ns") else {})}
    if config.get("beat_gate"):
        real_beat, gate = PartitionLock._heartbeat, config["beat_gate"]
        first = [True]

        def slow_beat(lock: PartitionLock) -> bool:
            if first[0]:
                first[0] = False
                while not os.path.exists(gate):  # a heartbeat write stuck in the network, then delivered
                    time.sleep(0.05)
                ok = real_beat(lock)
                answer(f"beat {'kept' if ok else 'refused'}")
                return ok
            return real_beat(lock)

        PartitionLock._heartbeat = slow_beat  # type: ignore[method-assign]


def answer(line: str) -> None:
    print(line, flush=True)


def commit(storage: Storage, label: str) -> None:
    """One stage commit of the partition: its `rejects` rows replaced by one row named `label`."""
    rows = pa.Table.from_pylist([reject_row(label, "photos", label, None, "samples", "corrupt_image", "x")],
                                schema=schemas.REJECTS)
    write_partition(storage, "rejects", rejects_predicate("photos", "samples"), rows)


def main() -> None:
    config = json.loads(sys.argv[1])
    simulate(config)
    storage = Storage(config["root"], config.get("options") or {})
    lock = PartitionLock(storage, "samples", "photos", ttl=float(config["ttl"]), run=config.get("run", "child"))
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        try:
            if command == "acquire":
                lock.acquire()
                answer("held")
            elif command == "commit":
                commit(storage, arg)
                answer("committed")
            elif command == "release":
                lock.release()
                answer("released")
            elif command == "exit":
                return
        except PartitionLocked as exc:
            answer(f"locked {exc}")
        except LockLost:
            answer("lost")


if __name__ == "__main__":
    main()
