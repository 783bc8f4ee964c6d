"""Automation: the partitions sensor, the weekly per-source schedule, the compaction job."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from pathlib import Path

import dagster as dg
import lance
from demo_corpus import Corpus, SOURCES, copy_corpus, read
from materializing import fresh_instance, materialize, resources_for

from prx_assets.automation import PER_SOURCE, compact_corpus, refresh_source_job, sources_sensor, weekly_source_refresh
from prx_assets.common import SOURCES as PARTITIONS
from prx_assets.common import sync_partitions
from prx_assets.definitions import build_assets
from prx_core.store.schemas import PARTITION_COLUMNS, TABLES
from prx_core.store.storage import Storage
from prx_resources import CatalogResource


def test_sensor_adds_missing_and_deletes_stale_partitions(corpus: Corpus) -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(PARTITIONS.name, ["web_images", "retired_source"])
    resources = {"catalog": CatalogResource(path=str(corpus.sources))}
    result = sources_sensor(dg.build_sensor_context(instance=instance, resources=resources))
    requests = result.dynamic_partitions_requests
    adds = [r for r in requests if isinstance(r, dg.AddDynamicPartitionsRequest)]
    deletes = [r for r in requests if isinstance(r, dg.DeleteDynamicPartitionsRequest)]
    assert [(r.partitions_def_name, list(r.partition_keys)) for r in adds] == [(PARTITIONS.name, ["stock_photos", "crawl_wds", "hf_photos"])]
    assert [(r.partitions_def_name, list(r.partition_keys)) for r in deletes] == [(PARTITIONS.name, ["retired_source"])]
    assert not result.run_requests

    # once applied, the catalog and the partitions agree: nothing to request
    instance.add_dynamic_partitions(PARTITIONS.name, ["stock_photos", "crawl_wds", "hf_photos"])
    instance.delete_dynamic_partition(PARTITIONS.name, "retired_source")
    again = sources_sensor(dg.build_sensor_context(instance=instance, resources=resources))
    assert not again.dynamic_partitions_requests and again.skip_reason is not None


def test_weekly_refresh_requests_one_run_per_partition(corpus: Corpus) -> None:
    when = dt.datetime(2026, 11, 29, 2, 0, tzinfo=dt.timezone.utc)
    with dg.instance_for_test() as instance:  # a schedule context needs an instance with a ref
        sync_partitions(instance, corpus.catalog)
        requests = weekly_source_refresh(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
    assert sorted(r.partition_key for r in requests) == sorted(SOURCES)
    assert len({r.run_key for r in requests}) == len(SOURCES)
    assert all("20261129" in r.run_key for r in requests)
    assert weekly_source_refresh.job_name == refresh_source_job.name == "refresh_source"
    assert weekly_source_refresh.cron_schedule == "0 2 * * 0"


def test_refresh_job_covers_the_per_source_chain_only(corpus: Corpus) -> None:
    defs = dg.Definitions(assets=build_assets(corpus.resources), jobs=[refresh_source_job], resources=corpus.resources)
    job = defs.resolve_job_def("refresh_source")
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == set(PER_SOURCE)


BUILT = [t for t in TABLES if t != "text_latents"]  # the demo's tables: text_latents is off


def fragments_and_rows(root: Path) -> dict[str, tuple[int, int]]:
    storage = Storage(str(root))
    out = {}
    for table in BUILT:
        ds = lance.dataset(storage.lance_uri(table))
        out[table] = (len(ds.get_fragments()), ds.count_rows())
    return out


def test_compact_corpus_keeps_tables_readable_with_fewer_fragments(corpus: Corpus, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "corpus")
    before = fragments_and_rows(root)
    samples_before = read(root, "samples", ["sample_id", "content_id"]).sort_by("sample_id").to_pylist()
    stream = sorted((root / "mds").glob("*/*/*/index.json"))[0].parent
    live = sorted(p for p in stream.iterdir() if p.is_dir())
    superseded, recent = stream / "c-superseded", stream / "c-recent"
    for planted in (superseded, recent):
        shutil.copytree(live[0], planted)
    week_ago = time.time() - 8 * 24 * 3600
    for path in [recent, *recent.iterdir()]:  # written long ago, but unreferenced since this run only: kept
        os.utime(path, (week_ago, week_ago))
    # what a publish records when an index drops a chunk: superseded 8 days ago, past the retention
    (stream / "superseded.json").write_text(json.dumps({"version": 1, "superseded": {superseded.name: week_ago}}))
    resources = resources_for(corpus, root)
    instance = fresh_instance(corpus.catalog)
    result = compact_corpus.execute_in_process(resources=resources, instance=instance)
    assert result.success
    after = fragments_and_rows(root)
    for table, (fragments, rows) in before.items():
        assert after[table][1] == rows, table
        assert after[table][0] <= fragments, (table, before[table], after[table])
    assert after["samples"][0] == before["samples"][0] == len(SOURCES)  # one fragment per source from ingest on: no rewrite
    assert after["mds_index"][0] < before["mds_index"][0]  # one fragment per chunk, merged per source
    for table in BUILT:
        assert read(root, table).num_rows == before[table][1]
    observations = {e.asset_key.to_user_string(): e.event_specific_data.asset_observation.metadata
                    for e in result.get_asset_observation_events()}
    assert {"samples", "buckets", "phashes", "duplicates"} <= set(observations)
    assert observations["samples"]["partitions_rewritten"].value == 0
    # MDS: the superseded chunk is gone after the retention, a recent one and the live ones stay
    assert not superseded.exists() and recent.exists() and all(p.exists() for p in live)
    # indexes survive and stay complete: full-text search over captions works
    captions = lance.dataset(Storage(str(root)).lance_uri("captions"))
    assert any(list(d.field_names) == ["caption"] for d in captions.describe_indices())

    # per-source tables were compacted partition by partition: no fragment mixes two
    storage = Storage(str(root))
    for table, columns in PARTITION_COLUMNS.items():
        if lance.dataset(storage.lance_uri(table)).count_rows():
            for fragment in lance.dataset(storage.lance_uri(table)).get_fragments():
                keys = fragment.to_table(columns=columns).group_by(columns).aggregate([])
                assert keys.num_rows == 1, (table, keys.to_pylist())

    # so a partition rerun after compaction drops whole fragments, with no deletion vector left
    rerun = materialize(resources, ["samples"], "web_images", instance)
    assert rerun.success
    assert read(root, "samples", ["sample_id", "content_id"]).sort_by("sample_id").to_pylist() == samples_before
    assert all(f.metadata.deletion_file is None for f in lance.dataset(storage.lance_uri("samples")).get_fragments())
