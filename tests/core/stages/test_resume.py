"""Kill a stage's driver (SIGKILL) after k of its n units and rerun it: the rerun runs exactly the
units that were not recorded, and the result equals a clean run. Also: the same outputs with one
Ray worker and with two."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from crash import kill_at, recorded_units
from test_mds_stage import CAPTIONER, add_captions
from test_row_stages import SIZES, make_samples
from test_stage_functions import jpeg

from prx_core.sources.catalog import SourceSpec
from prx_core.stages.buckets import build_buckets
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")

CALLS = {  # stage -> (pause point, the call the driver makes; `root` and `spec` are bound by the script)
    "samples": ("samples:units:2", "build_samples(spec, Storage(root), unit_bytes=1)"),
    "buckets": ("buckets:units:2", "build_buckets('photos', Storage(root), unit_rows=4)"),
    "skip_lists": ("skip_lists:chunks:2",
                   "build_skip_lists('photos', Storage(root), 'cap-v1', 'lab-v1', SkipPolicy(opt_out=('k0000', 'k0001', 'k0104')))"),
}
SCRIPT = """
import json, ray, sys
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.buckets import build_buckets
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store.storage import Storage
root, spec = sys.argv[1], SourceSpec.from_dict(json.loads(sys.argv[3]))
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
{call}
"""


def parquet_source(folder: Path, files: int = 6, rows: int = 5) -> SourceSpec:
    folder.mkdir(parents=True)
    for f in range(files):
        items = [{"key": f"k{f:02d}{i:02d}", "image": jpeg(*SIZES[(f + i) % len(SIZES)], seed=f * 100 + i),
                  "caption": f"photo {f} {i}"} for i in range(rows)]
        pq.write_table(pa.Table.from_pylist(items), folder / f"part-{f:05d}.parquet")
    return SourceSpec("photos", "parquet", str(folder), image_column="image", caption_column="caption", key_column="key")


def kill_after(stage: str, root: str, spec: SourceSpec, gcs: str) -> int:
    """Run the stage in a driver that pauses after its 2nd unit, SIGKILL it; returns the units recorded."""
    point, call = CALLS[stage]
    kill_at(point, SCRIPT.format(call=call), root, gcs, json.dumps(spec.to_dict()))
    return len(recorded_units(root, stage, "photos"))


@pytest.mark.parametrize("stage", ["samples", "buckets", "skip_lists"])
def test_a_killed_stage_reruns_only_its_unrecorded_units(stage: str, tmp_path: Path, ray_cluster) -> None:
    spec = parquet_source(tmp_path / "source")
    storage = Storage(str(tmp_path / "corpus"))
    if stage != "samples":
        build_samples(spec, storage)
    if stage == "skip_lists":
        add_captions(storage, skip=0)
        build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    clean = Storage(str(tmp_path / "clean"))
    if os.path.isdir(storage.root):
        shutil.copytree(storage.root, clean.root)
    recorded = kill_after(stage, storage.root, spec, ray_cluster.get_runtime_context().gcs_address)
    assert recorded >= 2
    if stage == "samples":
        report, reference = build_samples(spec, storage, unit_bytes=1), build_samples(spec, clean, unit_bytes=1)
        units, table = report.units, "samples"
    elif stage == "buckets":
        report, reference = build_buckets("photos", storage, unit_rows=4), build_buckets("photos", clean, unit_rows=4)
        units, table = report.units, "buckets"
    else:
        policy = SkipPolicy(opt_out=("k0000", "k0001", "k0104"))
        report = build_skip_lists("photos", storage, CAPTIONER, "lab-v1", policy)
        reference = build_skip_lists("photos", clean, CAPTIONER, "lab-v1", policy)
        units, table = report.units["chunks"], None
    assert units.skipped == recorded and units.ran == units.units - recorded
    if table:
        assert lance_io.partition_digest(storage.lance_uri(table), source_predicate("photos")) == \
            lance_io.partition_digest(clean.lance_uri(table), source_predicate("photos"))
    else:
        assert tree(Path(storage.root, "skiplists")) == tree(Path(clean.root, "skiplists")) != {}
        assert report.skipped == reference.skipped > 0


def tree(base: Path) -> dict[str, str]:
    return {p.relative_to(base).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(base.rglob("*")) if p.is_file()}


TWO_WORKERS = """
import sys
from prx_core.compute.quiet import start_ray
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.store.storage import Storage
start_ray(num_cpus=2, log_to_driver=False)
report = build_mds("photos", Storage(sys.argv[1]), "cap-v1", route_rows=7, chunk_rows=3)
assert report.units["chunks"].ran == report.units["chunks"].units
"""


def test_one_worker_and_two_write_the_same_bytes(tmp_path: Path) -> None:
    one = Storage(str(tmp_path / "one"))
    make_samples(one, "photos", 30, 2)
    add_captions(one)
    two = Storage(str(tmp_path / "two"))
    shutil.copytree(one.root, two.root)
    build_mds("photos", one, CAPTIONER, route_rows=7, chunk_rows=3)  # this process's Ray: one CPU
    subprocess.run([sys.executable, "-c", TWO_WORKERS, two.root], check=True, timeout=600,
                   env={k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")})
    assert tree(Path(one.root, "mds")) == tree(Path(two.root, "mds")) != {}
    assert lance_io.partition_digest(one.lance_uri("mds_index")) == lance_io.partition_digest(two.lance_uri("mds_index"))
