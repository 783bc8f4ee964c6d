"""`buckets` and `phashes` as work units on a real local Ray and real Lance tables: the same rows
as a single-process reference for any unit size, other partitions untouched, a rerun resumes
after a SIGKILL and redoes only the units that were not recorded."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from crash import kill_at, recorded_units
from test_stage_functions import jpeg, records

from prx_core.compute.units import RUNS
from prx_core.sources.ingest import ingest_batch
from prx_core.stages.buckets import bucket_samples, build_buckets
from prx_core.sources.ingest import inspect_image
from prx_core.stages.phashes import build_phashes
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_partition, rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
SIZES = [(640, 480), (512, 512), (300, 300), (1200, 500), (800, 1000), (2048, 1536), (700, 700)]


def make_samples(storage: Storage, source: str, n: int, fragments: int) -> pa.Table:
    """`n` samples of `source` in `fragments` fragments (a broken image included: phash rejects)."""
    items = [(f"k{i:03d}", jpeg(*SIZES[i % len(SIZES)], seed=i), f"caption {i}") for i in range(n)]
    samples, _ = ingest_batch(source, records(*items))
    for column in ("phash", "match_keys", "signature", "lossless"):  # some ingested before ingest took fingerprints:
        # `phashes` decodes their bytes, interleaved with copied fingerprints
        legacy = pa.array([None if i % 3 == 1 else v for i, v in enumerate(samples[column].to_pylist())],
                          samples.schema.field(column).type)
        samples = samples.set_column(samples.schema.get_field_index(column), column, legacy)
    broken = samples.slice(0, 1).to_pylist()[0] | {"sample_id": f"{source}/zz", "source_key": "zz", "image": b"\xff\xd8\xff",
                                                  "phash": None, "match_keys": None, "signature": None,
                                                  "lossless": None}  # as if ingested before ingest took fingerprints
    samples = pa.concat_tables([samples, pa.Table.from_pylist([broken], schema=schemas.SAMPLES)])
    uri, step = storage.lance_uri("samples"), -(-samples.num_rows // fragments)
    written = [f for i in range(0, samples.num_rows, step)
               for f in lance_io.write_fragments(uri, samples.slice(i, step), schemas.SAMPLES)]
    commit_partition(storage, "samples", source_predicate(source), written)
    return samples


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "other", 5, 1)
    make_samples(storage, "photos", 20, 3)
    return storage


def rows(storage: Storage, table: str, where: str) -> set[tuple]:
    return {tuple(sorted(r.items())) for r in lance_io.read_table(storage.lance_uri(table), filter=where).to_pylist()}


def reference_buckets(storage: Storage, source: str) -> tuple[set[tuple], set[tuple]]:
    samples = lance_io.read_table(storage.lance_uri("samples"), filter=source_predicate(source))
    buckets, rejects = bucket_samples(samples)
    return ({tuple(sorted(r.items())) for r in buckets.to_pylist()},
            {tuple(sorted(r.items())) for r in rejects.to_pylist()})


@pytest.mark.parametrize("unit_rows", [1, 4, 1000])
def test_buckets_units_give_the_reference_rows(storage: Storage, unit_rows: int) -> None:
    build_buckets("other", storage)
    other = rows(storage, "buckets", source_predicate("other"))
    report = build_buckets("photos", storage, unit_rows=unit_rows)
    want_buckets, want_rejects = reference_buckets(storage, "photos")
    assert rows(storage, "buckets", source_predicate("photos")) == want_buckets
    assert rows(storage, "rejects", rejects_predicate("photos", "buckets")) == want_rejects
    assert rows(storage, "buckets", source_predicate("other")) == other  # another partition untouched
    fragments = 3 if unit_rows == 1000 else sum(-(-n // unit_rows) for n in (7, 7, 7))
    assert report.units.units == report.units.ran == fragments and report.units.skipped == 0
    assert report.rows == 21 and report.bucketed + sum(report.dropped.values()) == 21
    assert sum(report.histogram.values()) == report.bucketed
    assert not os.listdir(os.path.join(storage.root, RUNS, "buckets", "photos"))  # the attempt is forgotten
    same = build_buckets("photos", storage, unit_rows=unit_rows)  # the same rows read: nothing runs
    assert (same.units.ran, same.units.skipped) == (0, fragments) and same.buckets_version == report.buckets_version
    assert force_next_run(storage, "buckets", "photos")  # forced: same rows, one more version
    again = build_buckets("photos", storage, unit_rows=unit_rows)
    assert rows(storage, "buckets", source_predicate("photos")) == want_buckets and again.units.ran == fragments


def test_phashes_units_give_the_reference_rows_and_reject_the_broken_image(storage: Storage) -> None:
    report = build_phashes("photos", storage, unit_rows=4)
    samples = lance_io.read_table(storage.lance_uri("samples"), filter=source_predicate("photos")).to_pylist()
    hashed = {r["sample_id"]: r for r in lance_io.read_table(storage.lance_uri("phashes")).to_pylist()}
    assert set(hashed) == {s["sample_id"] for s in samples} - {"photos/zz"}
    for sample in samples:
        if sample["sample_id"] in hashed:
            facts, row = inspect_image(sample["image"]), hashed[sample["sample_id"]]
            assert (row["phash"], row["pixels"], row["match_keys"], row["signature"], row["lossless"]) == (
                facts.phash, facts.width * facts.height, list(facts.match_keys), facts.signature, facts.lossless)
    rejected = lance_io.read_table(storage.lance_uri("rejects"), filter=rejects_predicate("photos", "phashes"))
    assert rejected["sample_id"].to_pylist() == ["photos/zz"]
    assert (report.rows, report.failed, report.units.units) == (20, 1, 6)


KILL_SCRIPT = """
import ray, sys
from prx_core.stages.phashes import build_phashes
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
build_phashes("photos", Storage(sys.argv[1]), unit_rows=2)
"""


def test_a_sigkilled_stage_resumes_from_its_recorded_units(storage: Storage, ray_cluster) -> None:
    """The driver dies after 3 units; the rerun with the same inputs runs only the others."""
    kill_at("phashes:units:3", KILL_SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address)
    recorded = len(recorded_units(storage.root, "phashes", "photos"))
    assert recorded >= 3
    assert not lance_io.table_exists(storage.lance_uri("phashes"))  # nothing committed by the killed run

    report = build_phashes("photos", storage, unit_rows=2)
    assert report.units.units == 12 and report.units.skipped == recorded and report.units.ran == 12 - recorded
    assert force_next_run(storage, "phashes", "photos")  # else the committed run is reused
    reference = build_phashes("photos", Storage(storage.root), unit_rows=2)  # a clean run on the same rows
    assert reference.units.ran == 12
    got = lance_io.partition_digest(storage.lance_uri("phashes"), source_predicate("photos"), version=report.phashes_version)
    assert got == lance_io.partition_digest(storage.lance_uri("phashes"), source_predicate("photos"))
    assert np.isfinite(report.images_per_second)
