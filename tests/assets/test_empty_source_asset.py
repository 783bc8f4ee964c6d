"""`samples` of a source folder that still exists but holds no file any more: the run fails before
any commit naming the source (its rows stay), and empties the partition only when its run config
says `allow_empty: true` (a real Dagster instance, real Lance, the session's local Ray)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from demo_corpus import image_folder_source, read
from materializing import fresh_instance, make_settings, materialize
from prx_cli.build import QUIET_LOGS

from prx_assets.definitions import build_assets, build_resources
from prx_core.sources.catalog import load_catalog


def test_an_emptied_source_is_refused_unless_the_run_allows_it(ray_session, tmp_path: Path) -> None:
    catalog = image_folder_source(tmp_path / "src", "photos", count=2)
    root = tmp_path / "corpus"
    resources = build_resources(make_settings(root, catalog))
    instance = fresh_instance(load_catalog(catalog))
    assert materialize(resources, ["samples"], "photos", instance).success
    assert len(read(root, "samples", ["sample_id"])) == 2

    for path in (tmp_path / "src" / "images" / "part_0").iterdir():
        path.unlink()  # the folder stays: a source matching no file
    refused = materialize(resources, ["samples"], "photos", instance)
    assert not refused.success
    (failure,) = [e for e in refused.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "EmptySource" in str(failure.event_specific_data.error) and "allow_empty: true" in str(
        failure.event_specific_data.error)
    assert len(read(root, "samples", ["sample_id"])) == 2  # nothing committed

    allowed = dg.materialize(build_assets(resources), selection=["samples"], partition_key="photos", instance=instance,
                             resources=resources, raise_on_error=False,
                             run_config={**QUIET_LOGS, "ops": {"samples": {"config": {"allow_empty": True}}}})
    assert allowed.success
    assert len(read(root, "samples", ["sample_id"])) == 0
