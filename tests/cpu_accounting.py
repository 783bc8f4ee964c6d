"""Per-test CPU seconds of the whole process tree, for cutting the suite's time where the work is.

Wall times (`--durations`) mislead on 2 cores shared by two pytest processes: a test waiting on a
daemon tick looks as costly as one compiling an engine. `PRX_TEST_CPU=FILE make test` appends one
JSON line per test: its wall seconds and the CPU seconds its pytest process and every descendant
(Ray's raylet and workers, CLI subprocesses, engines) spent meanwhile, read from /proc. A process
counts once: while alive, its own time; once reaped, in its parent's `cutime`. Processes that
escape the tree (re-parented to init) are not counted. Summed per module by
`python tests/cpu_accounting.py FILE...`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of it and its reaped children)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / TICKS)
    return out


def tree_cpu(root: int) -> float:
    stats = _stats()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in stats.items():
        children[parent].append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


class CpuAccounting:
    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        cpu, wall = tree_cpu(os.getpid()), time.monotonic()
        yield
        line = {"test": item.nodeid, "wall": round(time.monotonic() - wall, 2),
                "cpu": round(tree_cpu(os.getpid()) - cpu, 2)}
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")


def register(config: pytest.Config) -> None:
    if os.environ.get("PRX_TEST_CPU"):
        config.pluginmanager.register(CpuAccounting(os.environ["PRX_TEST_CPU"]), "prx-cpu-accounting")


def summarize(paths: list[str]) -> None:
    """CPU and wall seconds per module, the costliest first."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            module = row["test"].split("::")[0]
            cpu[module] += row["cpu"]
            wall[module] += row["wall"]
    print(f"{'cpu s':>8} {'wall s':>8}  module   (all: {sum(cpu.values()):.0f} CPU s, {sum(wall.values()):.0f} wall s)")
    for module in sorted(cpu, key=cpu.get, reverse=True):
        print(f"{cpu[module]:8.1f} {wall[module]:8.1f}  {module}")


if __name__ == "__main__":
    summarize(sys.argv[1:])
