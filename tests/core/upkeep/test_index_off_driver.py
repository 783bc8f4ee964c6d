"""Issue 24, hazard 5: a commit's index refresh never runs in the stage's driver when a cluster is
up (its memory grows with the delta: ~10 GB at 100M rows), yet the committed tables are indexed;
without a cluster it runs in the process, as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_row_stages import make_samples

from prx_core.stages.buckets import build_buckets
from prx_core.store import lance_io, maintenance
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

DRIVER = os.getpid()
REAL = maintenance.refresh_table_indexes


def refresh_anywhere_but_the_driver(*args, **kwargs):
    if os.getpid() == DRIVER:
        raise AssertionError("an index refresh ran in the driver")
    return REAL(*args, **kwargs)


def index_names(storage: Storage, table: str) -> set[str]:
    return {d.name for d in lance_io.require_table(storage.lance_uri(table)).describe_indices()}


def test_without_a_cluster_the_refresh_runs_in_the_process(tmp_path: Path) -> None:
    import ray

    if ray.is_initialized():  # left running by an earlier module: this test is about no cluster
        ray.shutdown()
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "photos", 4, 1)
    report = index_table(storage.lance_uri("samples"), "samples")
    assert report.version == lance_io.require_table(storage.lance_uri("samples")).version
    assert not ray.is_initialized()  # it did not start one


def test_a_stage_commit_indexes_on_a_worker(tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "photos", 20, 3)
    monkeypatch.setattr(maintenance, "refresh_table_indexes", refresh_anywhere_but_the_driver)
    report = build_buckets("photos", storage)
    assert report.bucketed > 0
    assert index_names(storage, "buckets") == {"content_id_btree", "sample_id_btree", "source_bitmap"}
    assert "source_bitmap" in index_names(storage, "rejects")
