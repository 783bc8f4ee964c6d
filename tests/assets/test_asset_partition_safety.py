"""A `sources` partition that is not a catalog source (anyone with the UI or GraphQL can add `..`
or `evil`) fails every asset before it touches storage; two runs of one partition at once: one
fails naming the other, the table holds one run's rows; the run queue never starts two runs of
one partition (dagster.yaml)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from demo_corpus import image_folder_source, read
from materializing import fresh_instance, materialize, materialized
from dagster._utils.tags import TagConcurrencyLimitsCounter

from prx_assets.definitions import build_resources
from prx_assets.settings import Settings
from prx_core.sources.catalog import load_catalog

REPO = Path(__file__).resolve().parents[2]
PARTITIONED = ["raw_source", "samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings",
               "mds_shards", "skip_lists", "explorer"]


def failure_text(result: dg.ExecuteInProcessResult) -> str:
    """The step failures' descriptions and errors, as the run log shows them."""
    parts = []
    for event in result.get_step_failure_events():
        data = event.step_failure_data
        parts.append(data.user_failure_data.description if data.user_failure_data else "")
        error = data.error
        while error is not None:  # the step error, then what caused it
            parts.append(error.message)
            error = error.cause
    return "\n".join(p for p in parts if p)


@pytest.fixture
def one_source(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    catalog = image_folder_source(tmp_path / "src", "photos", count=2)
    return build_resources(Settings(root=str(tmp_path / "corpus"), sources=str(catalog))), catalog


@pytest.mark.parametrize("key", ["evil", ".."])
def test_a_partition_not_in_the_catalog_fails_every_asset_before_storage(ray_session, tmp_path: Path,
                                                                        one_source: tuple[dict, Path], key: str) -> None:
    resources, catalog = one_source
    root = tmp_path / "corpus"
    (tmp_path / "sentinel.txt").write_text("outside the corpus")
    instance = fresh_instance(load_catalog(catalog))
    instance.add_dynamic_partitions("sources", [key])  # as the UI or the GraphQL API can
    for asset in PARTITIONED:
        result = materialize(resources, [asset], key, instance)
        assert not result.success and not materialized(result), asset
        text = failure_text(result)
        assert f"partition {key!r} of asset {asset!r} is not a source of the catalog" in text, (asset, text)
        assert not root.exists(), asset  # not a lock, not a run folder, not a table
    assert (tmp_path / "sentinel.txt").read_text() == "outside the corpus"


def test_two_runs_of_one_partition_one_fails_naming_the_other(ray_session, tmp_path: Path,
                                                               one_source: tuple[dict, Path]) -> None:
    resources, catalog = one_source
    instance = fresh_instance(load_catalog(catalog))
    lock = tmp_path / "corpus" / "_locks" / "samples" / "photos.lock"
    results: dict[str, dg.ExecuteInProcessResult] = {}
    first = threading.Thread(target=lambda: results.update(first=materialize(resources, ["samples"], "photos", instance)))
    first.start()
    deadline = time.monotonic() + 120
    while not lock.exists() and first.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    results["second"] = materialize(resources, ["samples"], "photos", instance)  # while the first one writes
    first.join()

    assert results["first"].success and not results["second"].success
    text = failure_text(results["second"])
    assert (f"partition 'photos' of asset 'samples' is being written by dagster run {results['first'].run_id} since"
            in text), text
    assert read(tmp_path / "corpus", "samples", ["sample_id"]).num_rows == 2  # one run's rows, not 4
    assert not lock.exists()
    again = materialize(resources, ["samples"], "photos", instance)  # released: the next run goes on
    assert again.success and read(tmp_path / "corpus", "samples", ["sample_id"]).num_rows == 2


def test_the_run_queue_starts_one_run_per_partition(tmp_path: Path) -> None:
    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
    running = dg.DagsterRun(job_name="__ASSET_JOB", run_id="a" * 36, tags={"dagster/partition": "photos"})
    counter = TagConcurrencyLimitsCounter(limits, [running])
    same = dg.DagsterRun(job_name="__ASSET_JOB", run_id="b" * 36, tags={"dagster/partition": "photos"})
    other = dg.DagsterRun(job_name="__ASSET_JOB", run_id="c" * 36, tags={"dagster/partition": "web_images"})
    assert counter.is_blocked(same) and not counter.is_blocked(other)
