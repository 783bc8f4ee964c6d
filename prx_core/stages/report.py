"""What every stage's report answers, whatever else it holds: the rows the stage produced, its
seconds, the Lance versions it read and wrote, and its units. The asset layer and the benchmark read
any report through `summary()` instead of knowing each stage's field names.

Reports keep their own field names: committed reports are stored as JSON and decoded by field name
(`unchanged.committed_report`), so renaming `samples_version` would make every unchanged partition
redo its work once. Each report class declares instead which of its fields these are; by convention
`seconds`, `units` and `read_versions` (table -> pinned input version) are read where a report has
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from prx_core.compute.unit_results import UnitResults


@dataclass(frozen=True)
class ReportSummary:
    rows: int  # what the stage produced or, for a stage that produces per input, what it read
    seconds: float | None  # None where the stage does not time itself
    versions: dict[str, int] = field(default_factory=dict)  # table -> Lance version, read and written
    units: UnitResults | Mapping[str, UnitResults] | None = None  # one phase, or phase -> results


class StageReport:
    """Base of the stage reports: `ROWS` names the field counted as the stage's rows, `READ` and
    `WRITTEN` map a table to the field holding the version read or written."""

    ROWS: ClassVar[str] = "rows"
    READ: ClassVar[Mapping[str, str]] = {}
    WRITTEN: ClassVar[Mapping[str, str]] = {}

    def summary(self) -> ReportSummary:
        versions = dict(getattr(self, "read_versions", None) or {})
        for table, name in {**self.READ, **self.WRITTEN}.items():
            if (version := getattr(self, name)) is not None:
                versions[table] = int(version)
        return ReportSummary(int(getattr(self, self.ROWS)), getattr(self, "seconds", None), versions,
                             getattr(self, "units", None) or None)


def summarize(report: Any, **versions: int | None) -> ReportSummary:
    """The summary of a wrapped report (a stage's `then` step adds to it), with the versions the
    wrapper read added."""
    inner = report.summary()
    return replace(inner, versions={**inner.versions, **{t: int(v) for t, v in versions.items() if v is not None}})
