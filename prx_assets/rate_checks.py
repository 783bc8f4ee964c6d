"""Blocking checks that block on a failure rate above a configured threshold, never on one sample
(prx_resources.checks.ChecksResource): the result names the count, the rate, the threshold and
a few offending samples, whichever way it goes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from prx_assets.common import md_table
from prx_resources.checks import ChecksResource

OFFENDER_COLUMNS = ["sample_id", "content_id", "reason"]


def rate_description(check: str, what: str) -> str:
    """A check spec's description (specs are built before the resource is read: name the setting)."""
    default = ChecksResource.model_fields[check].default
    return (f"{what} Blocks when the share failing is above `checks.{check}` in PRX_CONFIG (default {default:.1%}); "
            "below it passes, with the count, the rate and the offending samples in its metadata.")


def rate_check(
    check: str, checks: ChecksResource, *, checked: int, failed: int, offenders: Sequence[Mapping[str, Any]] = (),
    **extra: Any,
) -> dg.AssetCheckResult:
    """Passed when failed / checked <= the check's threshold; `extra` keeps the check's own counts."""
    max_rate = checks.max_rate(check)
    rate = failed / checked if checked else 0.0
    shown = [{c: row.get(c) for c in OFFENDER_COLUMNS} for row in list(offenders)[:checks.examples]]
    return dg.AssetCheckResult(
        check_name=check, passed=rate <= max_rate, severity=dg.AssetCheckSeverity.ERROR,
        description=(f"{failed} of {checked} failed ({rate:.3%}); "
                     f"{'at most' if rate <= max_rate else 'above'} the threshold {max_rate:.3%}"),
        metadata={**extra, "checked": checked, "failed": failed, "failure_rate": round(rate, 6),
                  "max_failure_rate": max_rate,
                  "offenders": md_table(shown, OFFENDER_COLUMNS),
                  "offender_ids": dg.MetadataValue.json([row["sample_id"] or row["content_id"] for row in shown])},
    )
