"""What `run_units` returns: every unit's summary of one attempt, in plan order, with totals."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class UnitResults:
    """Per-unit summaries of a whole attempt, in plan order, and what this call did."""

    summaries: list[dict[str, Any]]
    ran: int
    skipped: int
    seconds: float

    @property
    def units(self) -> int:
        return len(self.summaries)

    def total(self, key: str) -> int:
        return sum(int(s.get(key) or 0) for s in self.summaries)

    def counts(self, key: str) -> dict[str, int]:
        """The units' `key` counters (e.g. rejects by reason) added up."""
        total: Counter[str] = Counter()
        for summary in self.summaries:
            total.update(summary.get(key) or {})
        return dict(sorted(total.items()))

    def failed(self) -> list[str]:
        """Units that failed and were recorded by the stage's `on_failed` (their loss as rejects)."""
        return [s["unit"] for s in self.summaries if s.get("failed")]

    def worker_peak_rss_mb(self) -> float:
        return max((float(s.get("worker_peak_rss_mb") or 0) for s in self.summaries), default=0.0)

    def nodes(self) -> set[str]:
        return {s["node"] for s in self.summaries if s.get("node")}
