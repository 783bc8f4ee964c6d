"""`samples` when a unit keeps failing: a fragment whose reading hangs (a real local Ray, real
Lance; the hang is the `samples:fragment:<name>` pause point, set in the workers' environment)
is cancelled at the unit time limit and becomes one `unreadable_fragment` reject carrying the
error, while the other fragments' rows are committed and the run succeeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")

SCRIPT = """
import json, ray, sys
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage
root, spec, point = sys.argv[1], SourceSpec.from_dict(json.loads(sys.argv[3])), sys.argv[4]
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False, runtime_env={"env_vars": {"PRX_PAUSE_AT": point}})
report = build_samples(spec, Storage(root), unit_bytes=1, unit_seconds=float(sys.argv[5]))
print(json.dumps({"rows": report.rows, "reasons": report.reasons, "failed": report.units.failed()}))
"""


def parquet_source(folder: Path, photos: list[bytes], files: int = 3) -> SourceSpec:
    folder.mkdir(parents=True)
    for f in range(files):
        rows = [{"key": f"k{f}{i}", "image": photos[(f + i) % len(photos)], "caption": f"photo {f} {i}"} for i in range(2)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{f:05d}.parquet")
    return SourceSpec("photos", "parquet", str(folder), image_column="image", caption_column="caption", key_column="key")


def test_a_hung_fragment_becomes_a_reject_and_the_rest_is_committed(tmp_path: Path, photos: list[bytes],
                                                                    ray_cluster) -> None:
    spec = parquet_source(tmp_path / "src", photos)
    root = str(tmp_path / "corpus")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, root, ray_cluster.get_runtime_context().gcs_address,
         json.dumps(spec.to_dict()), "samples:fragment:part-00001.parquet", "8"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"rows": 4, "reasons": {"unreadable_fragment": 1}, "failed": ["u000001"]}, report
    storage = Storage(root)
    keys = lance.dataset(storage.lance_uri("samples")).to_table(columns=["source_key"], filter=source_predicate("photos"))
    assert sorted(keys["source_key"].to_pylist()) == ["k00", "k01", "k20", "k21"]
    rejects = lance.dataset(storage.lance_uri("rejects")).to_table(filter=rejects_predicate("photos", "samples"))
    (row,) = rejects.to_pylist()
    assert row["reason"] == "unreadable_fragment" and row["source_key"].endswith("part-00001.parquet")
    assert "unit u000001 timed out" in row["message"] and "over the 8 s time limit" in row["message"]


def test_without_faults_every_fragment_is_read(tmp_path: Path, photos: list[bytes], ray_cluster) -> None:
    report = build_samples(parquet_source(tmp_path / "src", photos), Storage(str(tmp_path / "corpus")), unit_bytes=1)
    assert (report.rows, report.rejected, report.units.failed()) == (6, 0, [])

