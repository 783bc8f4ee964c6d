"""`checks:` in PRX_CONFIG: documented defaults, per-check thresholds, and a misspelt name or an
impossible rate refused with a message naming the fix (it would otherwise keep the default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from prx_assets.definitions import build_resources
from prx_assets.settings import load_settings
from prx_resources.checks import RATE_CHECKS, ChecksResource


def resources_from(tmp_path: Path, checks: dict) -> dict:
    config = tmp_path / "prx.yaml"
    config.write_text(yaml.safe_dump({"checks": checks}))
    return build_resources(load_settings({"PRX_CONFIG": str(config), "PRX_ROOT": str(tmp_path)}))


def test_defaults_are_a_tenth_of_a_percent_and_twenty_examples() -> None:
    """Failures a tenth of a percent; rejected captions (the model's, not the pipeline's) warn at 1%, fail at 5%."""
    checks = ChecksResource()
    rates = {name: checks.max_rate(name) for name in RATE_CHECKS}
    assert rates.pop("captions_quality") == 0.05 and checks.captions_quality_warn == 0.01  # rejected captions
    assert rates == dict.fromkeys(rates, 0.001)
    assert checks.examples == 20


def test_prx_config_sets_one_check(tmp_path: Path) -> None:
    checks = resources_from(tmp_path, {"captions_coverage": 0.05, "examples": 5})["checks"]
    assert checks.max_rate("captions_coverage") == 0.05 and checks.max_rate("caption_labels_coverage") == 0.001
    assert checks.examples == 5


@pytest.mark.parametrize("checks, message", [
    ({"caption_coverage": 0.1}, "unknown setting.*caption_coverage.*valid: .*captions_coverage"),
    ({"captions_coverage": 1.5}, "less than or equal to 1"),
    ({"examples": 1000}, "less than or equal to 100"),
])
def test_bad_settings_are_refused(tmp_path: Path, checks: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        resources_from(tmp_path, checks)


def test_invariant_checks_have_no_threshold() -> None:
    with pytest.raises(ValueError, match="not a rate check"):
        ChecksResource().max_rate("mds_shards_readable")
