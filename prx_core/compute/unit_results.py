"""What `run_units` returns: every unit's summary of one attempt, in plan order, with totals.

On the driver a stage commits from the summaries (fragment metadata, file names: ~2 KB per unit).
A report carries them condensed (`condense_report`): totals, counters, the failed units and the
peaks, a few hundred bytes whatever the unit count, with every summary written once under
`<root>/_reports/<asset>/<partition>/` and referenced by `detail_uri`. A report of 25,000 units
(a 100M-row source) stays far below the 4 MiB a Ray job's log line may carry.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prx_core.store.storage import Storage, put_atomic

REPORTS = "_reports"
KEEP_REPORTS = 20  # per (asset, partition): the detail of the latest runs
FAILED_LISTED = 100  # failed unit ids a condensed report names (all are in the detail)


@dataclass
class UnitResults:
    """Per-unit summaries of a whole attempt, in plan order, and what this call did; condensed
    (`aggregate` set, `summaries` empty) once it is part of a report."""

    summaries: list[dict[str, Any]]
    ran: int
    skipped: int
    seconds: float
    aggregate: dict[str, Any] | None = None
    detail_uri: str | None = None  # every unit's summary, JSON lines (gzip), once condensed

    @property
    def units(self) -> int:
        return self.aggregate["units"] if self.aggregate is not None else len(self.summaries)

    def total(self, key: str) -> int:
        if self.aggregate is not None:
            return int(self.aggregate["totals"].get(key, 0))
        return sum(int(s.get(key) or 0) for s in self.summaries)

    def counts(self, key: str) -> dict[str, int]:
        """The units' `key` counters (e.g. rejects by reason) added up."""
        if self.aggregate is not None:
            return dict(self.aggregate["counts"].get(key, {}))
        total: Counter[str] = Counter()
        for summary in self.summaries:
            total.update(summary.get(key) or {})
        return dict(sorted(total.items()))

    def failed(self) -> list[str]:
        """Units that failed and were recorded by the stage's `on_failed` (their loss as rejects);
        condensed, the first `FAILED_LISTED` of them (`total("failed_units")` counts them all)."""
        if self.aggregate is not None:
            return list(self.aggregate["failed"])
        return [s["unit"] for s in self.summaries if s.get("failed")]

    def worker_peak_rss_mb(self) -> float:
        if self.aggregate is not None:
            return float(self.aggregate["worker_peak_rss_mb"])
        return max((float(s.get("worker_peak_rss_mb") or 0) for s in self.summaries), default=0.0)

    def nodes(self) -> set[str]:
        if self.aggregate is not None:
            return set(self.aggregate["nodes"])
        return {s["node"] for s in self.summaries if s.get("node")}

    def condensed(self, detail_uri: str | None = None) -> UnitResults:
        """The same results as totals and counters: every numeric key summed, every mapping of
        counts added up, the failed units and the peaks; no per-unit summary."""
        if self.aggregate is not None:
            return self
        totals: Counter[str] = Counter()
        counts: dict[str, Counter[str]] = {}
        for summary in self.summaries:
            for key, value in summary.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    totals[key] += value
                elif isinstance(value, Mapping) and all(isinstance(v, int) for v in value.values()):
                    counts.setdefault(key, Counter()).update(value)
        failed = self.failed()
        totals["failed_units"] = len(failed)
        aggregate = {"units": len(self.summaries), "totals": dict(sorted(totals.items())),
                     "counts": {k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
                     "failed": failed[:FAILED_LISTED], "worker_peak_rss_mb": self.worker_peak_rss_mb(),
                     "nodes": sorted(self.nodes())}
        return UnitResults([], self.ran, self.skipped, self.seconds, aggregate, detail_uri)


def condense_report(report: Any, storage: Storage, asset: str, partition: str, token: str) -> Any:
    """`report` with every `UnitResults` in it condensed, its summaries written to one detail file
    per phase."""
    return map_unit_results(report, lambda results, phase: _condense(results, storage, asset, partition, token, phase))


def map_unit_results(report: Any, fn: Callable[[UnitResults, str], UnitResults]) -> Any:
    """`report` with `fn(results, phase)` in place of every `UnitResults` in it: a field, or a
    field mapping phases to them, at any depth of nested reports (the field name is the phase)."""
    if not dataclasses.is_dataclass(report) or isinstance(report, (type, UnitResults)):
        return report
    for item in dataclasses.fields(report):
        value = getattr(report, item.name)
        if isinstance(value, UnitResults):
            setattr(report, item.name, fn(value, item.name))
        elif isinstance(value, dict) and value and all(isinstance(v, UnitResults) for v in value.values()):
            setattr(report, item.name, {phase: fn(r, phase) for phase, r in value.items()})
        elif dataclasses.is_dataclass(value):
            map_unit_results(value, fn)
    return report


def _condense(results: UnitResults, storage: Storage, asset: str, partition: str, token: str,
              phase: str) -> UnitResults:
    if results.aggregate is not None:
        return results
    now = time.time_ns()  # one reading: the seconds and their fraction from two could straddle a second
    stamp = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now // 10**9))}.{now % 10**9:09d}"  # names sort by time
    uri = write_detail(storage, asset, partition, f"{stamp}-{token}-{phase}", results.summaries) if results.summaries else None
    return results.condensed(uri)


def write_detail(storage: Storage, asset: str, partition: str, name: str, summaries: list[dict[str, Any]]) -> str:
    """Every unit summary of one phase as gzipped JSON lines; only the latest KEEP_REPORTS per
    (asset, partition) are kept (the names sort by time)."""
    fs = storage.filesystem()
    folder = storage.uri(REPORTS, asset, partition)
    uri = f"{folder}/{name}.jsonl.gz"
    lines = "".join(json.dumps(s, sort_keys=True, default=str) + "\n" for s in summaries)
    put_atomic(fs, uri, gzip.compress(lines.encode(), compresslevel=5))
    fs.invalidate_cache(folder)
    older = sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".jsonl.gz"))[:-KEEP_REPORTS]
    if older:
        fs.rm(older)
    return uri


def read_detail(storage: Storage, uri: str) -> list[dict[str, Any]]:
    """The unit summaries a condensed report's `detail_uri` names."""
    with storage.filesystem().open(uri, "rb") as handle:
        return [json.loads(line) for line in gzip.decompress(handle.read()).decode().splitlines() if line]
