"""`captions_quality`: the share of eligible captions the caption checks rejected passes up to
`checks.captions_quality_warn`, warns (without blocking) up to `checks.captions_quality`, and fails
(blocking) above, with the counts per problem and the rejected samples in its metadata."""

from __future__ import annotations

import dagster as dg
import pytest
from pydantic import ValidationError

from prx_assets.captions import CHECKS, quality_check
from prx_core.stages.captions.report import CaptionsReport
from prx_resources.checks import ChecksResource


def report(rejected: int, eligible: int = 1000) -> CaptionsReport:
    quality = {"ok": eligible - rejected - 7, "retried:repetition": 7}
    if rejected:
        quality |= {"rejected:token_cap": rejected - rejected // 2, "rejected:refusal": rejected // 2}
    return CaptionsReport("web", eligible, 0, eligible, 0, 1.0, quality=quality, fallbacks=rejected + 7,
                          rejected_offenders=[{"sample_id": "web/k1", "content_id": "c1", "reason": "token_cap"}])


@pytest.mark.parametrize(("rejected", "passed", "severity"), [
    (0, True, dg.AssetCheckSeverity.ERROR), (10, True, dg.AssetCheckSeverity.ERROR),
    (11, False, dg.AssetCheckSeverity.WARN), (50, False, dg.AssetCheckSeverity.WARN),
    (51, False, dg.AssetCheckSeverity.ERROR)])
def test_rejected_share_passes_warns_then_fails(rejected: int, passed: bool, severity: dg.AssetCheckSeverity) -> None:
    result = quality_check(ChecksResource(), report(rejected))
    assert (result.check_name, result.passed, result.severity) == ("captions_quality", passed, severity)
    meta = {k: v.value for k, v in result.metadata.items()}
    assert (meta["checked"], meta["failed"], meta["max_failure_rate"], meta["warn_above"]) == (1000, rejected, 0.05, 0.01)
    assert meta["verdicts"]["retried"] == 7 and meta["verdicts"].get("rejected", 0) == rejected
    assert meta["fallbacks"] == rejected + 7 and "| repetition | 7 | 0 | 0 |" in meta["problems"]
    assert meta["offender_ids"] == ["web/k1"]


def test_thresholds_come_from_the_checks_settings() -> None:
    strict = ChecksResource(captions_quality=0.002, captions_quality_warn=0.0)
    assert quality_check(strict, report(1)).severity == dg.AssetCheckSeverity.WARN
    assert not quality_check(strict, report(3)).passed
    with pytest.raises(ValidationError, match="captions_quality_warn"):
        ChecksResource(captions_quality=0.01, captions_quality_warn=0.02)
    assert [c.name for c in CHECKS] == ["captions_coverage", "captions_quality"] and all(c.blocking for c in CHECKS)
