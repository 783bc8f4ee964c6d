"""pytest plugin: each test's CPU-seconds, its whole process tree included (scripts/suite_cpu.sh).

A test's Ray, Dagster and CLI processes are re-parented to init, so per-process accounting (rusage of
children) loses them; a cgroup-v1 `cpuacct` group keeps every descendant, re-parented or not. The
group is the one `PRX_CPUACCT_GROUP` names (this pytest runs inside it); one line per test, tab-separated:
CPU seconds, wall seconds, node id, appended to `PRX_CPUACCT_OUT`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

GROUP = os.environ.get("PRX_CPUACCT_GROUP", "")
OUT = os.environ.get("PRX_CPUACCT_OUT", "cpuacct.tsv")


def group_cpu_seconds() -> float:
    with open(f"/sys/fs/cgroup/cpuacct/{GROUP}/cpuacct.usage") as usage:
        return int(usage.read()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not GROUP:
        yield
        return
    cpu, wall = group_cpu_seconds(), time.monotonic()
    yield
    with open(OUT, "a") as out:
        out.write(f"{group_cpu_seconds() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{item.nodeid}\n")
