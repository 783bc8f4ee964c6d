"""`samples` units cut by rows or files where bytes mislead (issue 41, item 1): a one-file URL table
of 200k rows on the loopback HTTP server becomes 20 units whose every row is a sample or a reject
with a reason; the default size cuts it too; a rerun commits nothing; a unit that keeps failing
costs only its own rows (each a reject); a flat folder of 100k files is planned as 10 units
without a record per file, and a folder read in name ranges gives every file once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jpegs import jpeg
from http_server import serving

from prx_core.sources.catalog import DownloadSettings, SourceSpec
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.samples.units import UNIT_BYTES, UNIT_FILES, UNIT_ROWS, group_fragments, plan_units
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

ROWS = 200_000
FAST = DownloadSettings(read_timeout_s=2, retries=0, allow_networks=("127.0.0.1/32",), honor_opt_out=False)
SCRIPT = """
import json, ray, sys
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage
root, spec, point = sys.argv[1], SourceSpec.from_dict(json.loads(sys.argv[3])), sys.argv[4]
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False, runtime_env={"env_vars": {"PRX_PAUSE_AT": point}})
report = build_samples(spec, Storage(root), unit_rows=int(sys.argv[5]), unit_seconds=float(sys.argv[6]))
print(json.dumps({"rows": report.rows, "rejected": report.rejected, "reasons": report.reasons,
                  "failed": report.units.failed(), "units": report.units.units}))
"""


@pytest.fixture(scope="module")
def server():
    tiny = jpeg(np.random.default_rng(0).integers(0, 255, (24, 32, 3), dtype=np.uint8))
    with serving({"tiny": tiny}) as running:
        yield running


def url_for(server, i: int) -> str:
    """1 row in 100 a real image, 4 a 404, 15 a private address the source may not reach (refused
    before any request), the rest no URL at all (refused as it is read: a 2-core test has no time
    for 200k requests): every row must end as a sample or a reject with its reason."""
    if i % 100 == 0:
        return server.url(f"/photo/tiny/{i}")
    if i % 100 < 5:
        return server.url(f"/missing/{i}")
    return f"http://10.0.0.1/images/{i}.jpg" if i % 100 < 20 else ""


def url_table(folder: Path, server, rows: int, row_group: int) -> SourceSpec:
    folder.mkdir(parents=True)
    urls = [url_for(server, i) for i in range(rows)]
    pq.write_table(pa.table({"URL": urls, "TEXT": [f"photo {i}" for i in range(rows)]}), folder / "urls.parquet",
                   row_group_size=row_group)
    return SourceSpec("laion", "parquet", str(folder), url_column="URL", caption_column="TEXT", download=FAST)


def partition_keys(root: str, table: str) -> list[str]:
    storage = Storage(root)
    predicate = source_predicate("laion") if table == "samples" else rejects_predicate("laion", "samples")
    return lance.dataset(storage.lance_uri(table)).to_table(columns=["source_key"], filter=predicate)[
        "source_key"].to_pylist()


def test_a_200k_url_table_is_many_units_and_every_row_a_sample_or_a_reject(tmp_path: Path, server,
                                                                           ray_cluster) -> None:
    spec = url_table(tmp_path / "laion", server, ROWS, row_group=20_000)
    assert len(group_fragments(fragment_sizes(spec), UNIT_BYTES)) == 1  # by bytes: one unit of 200k fetches
    default = plan_units(spec, None, UNIT_BYTES, UNIT_ROWS, UNIT_FILES)
    assert len(default.units) == 2 and {u.rows for u in default.units} == {UNIT_ROWS}
    assert [u.spec["part"] for u in default.units] == [[0, 100_000], [100_000, 200_000]]
    assert default.pinned == {"unit_rows": UNIT_ROWS}

    root = str(tmp_path / "corpus")
    report = build_samples(spec, Storage(root), unit_rows=10_000)
    assert report.units.units == 20 and report.units.failed() == []
    assert report.rows + report.rejected == ROWS
    assert report.reasons == {"download_error": 168_000, "url_not_allowed": 30_000}, report.reasons
    samples, rejects = partition_keys(root, "samples"), partition_keys(root, "rejects")
    assert len(samples) == 2_000 and len(samples) + len(rejects) == ROWS
    assert set(samples) | set(rejects) == {f"urls:{i}" for i in range(ROWS)}  # default keys: the cut is invisible

    fetched = len(server.paths())
    versions = {t: lance.dataset(Storage(root).lance_uri(t)).version for t in ("samples", "rejects")}
    again = build_samples(spec, Storage(root), unit_rows=10_000)
    assert (again.rows, again.rejected) == (report.rows, report.rejected)
    assert {t: lance.dataset(Storage(root).lance_uri(t)).version for t in ("samples", "rejects")} == versions
    assert len(server.paths()) == fetched  # nothing fetched again, nothing committed


def test_a_hugging_face_url_dataset_is_cut_by_rows_as_a_parquet_table_is(tmp_path: Path, server, ray_cluster) -> None:
    """A Hub snapshot of URLs (LAION-style: parquet files under data/, written here by `datasets`
    itself) used to be one unit per file, however many rows; its parquet files are now cut at row
    groups, the keys as a whole read gives them. An Arrow file (`save_to_disk`) cannot count its
    rows without reading them: it stays whole."""
    import datasets

    datasets.disable_progress_bars()
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: cc-by-4.0\n---\n")
    for n in range(2):
        rows = range(n * 10_000, (n + 1) * 10_000)
        datasets.Dataset.from_dict({"url": [url_for(server, i) for i in rows], "text": [f"photo {i}" for i in rows]}) \
            .to_parquet(str(folder / "data" / f"train-0000{n}-of-00002.parquet"), batch_size=2_500)  # row groups
    spec = SourceSpec("hub", "huggingface", str(folder), url_column="url", download=FAST)
    plan = plan_units(spec, None, UNIT_BYTES, 5_000, UNIT_FILES)
    assert [u.rows for u in plan.units] == [5_000] * 4 and plan.pinned == {"unit_rows": 5_000}
    assert [u.spec["part"] for u in plan.units] == [[0, 5_000], [5_000, 10_000]] * 2
    whole = {r["source_key"] for f, _ in fragment_sizes(spec) for b in read_fragment(spec, f) for r in b.to_pylist()}
    assert len(whole) == 20_000

    root = str(tmp_path / "corpus")
    report = build_samples(spec, Storage(root), unit_rows=5_000)
    assert report.units.units == 4 and report.units.failed() == [] and report.rows + report.rejected == 20_000
    storage = Storage(root)
    samples = lance.dataset(storage.lance_uri("samples")).to_table(columns=["source_key"], filter=source_predicate("hub"))
    rejects = lance.dataset(storage.lance_uri("rejects")).to_table(columns=["source_key"],
                                                                   filter=rejects_predicate("hub", "samples"))
    assert samples.num_rows == 200 and set(samples["source_key"].to_pylist()) | set(rejects["source_key"].to_pylist()) == whole

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"url": [url_for(server, i) for i in range(12_000)]}).save_to_disk(str(saved))
    arrow = SourceSpec("saved", "huggingface", str(saved), url_column="url", download=FAST)
    assert [(u.rows, u.spec.get("part")) for u in plan_units(arrow, None, UNIT_BYTES, 5_000, UNIT_FILES).units] == [
        (0, None)]  # one unit, read whole


def test_a_unit_that_keeps_failing_costs_only_its_own_rows(tmp_path: Path, server, ray_cluster) -> None:
    rows = 20_000
    spec = url_table(tmp_path / "laion", server, rows, row_group=2_000)
    root = str(tmp_path / "corpus")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, root, ray_cluster.get_runtime_context().gcs_address, json.dumps(spec.to_dict()),
         "samples:unit:u000003", "2000", "6"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["units"] == 10 and report["failed"] == ["u000003"], report
    assert report["rows"] + report["rejected"] == rows and report["reasons"]["unreadable_fragment"] == 2_000, report
    samples, rejects = partition_keys(root, "samples"), partition_keys(root, "rejects")
    assert len(samples) == 180 and set(samples) | set(rejects) == {f"urls:{i}" for i in range(rows)}
    lost = lance.dataset(Storage(root).lance_uri("rejects")).to_table(
        filter=rejects_predicate("laion", "samples") + " AND reason = 'unreadable_fragment'").to_pylist()
    assert sorted(int(r["source_key"].split(":")[1]) for r in lost) == list(range(6_000, 8_000))
    assert "unit u000003 timed out" in lost[0]["message"] and "rows 6000-8000" in lost[0]["message"]


def test_a_flat_folder_of_100k_files_is_cut_into_name_ranges(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("flat") / "photos"
    folder.mkdir()
    for i in range(100_000):
        (folder / f"{i:06d}.jpg").write_bytes(b"x")
    spec = SourceSpec("flat", "imagefolder", str(folder))
    assert len(group_fragments(fragment_sizes(spec), UNIT_BYTES)) == 1  # one folder: one unit, whatever its size
    plan = plan_units(spec, None, UNIT_BYTES, UNIT_ROWS, 10_000)
    assert len(plan.units) == 10 and all(u.rows == 10_000 for u in plan.units) and plan.pinned == {"unit_files": 10_000}
    assert [u.spec["part"] for u in plan.units][:2] == [[None, "010000.jpg"], ["010000.jpg", "020000.jpg"]]
    assert plan.units[-1].spec["part"] == ["090000.jpg", None]
    default = plan_units(spec, None, UNIT_BYTES, UNIT_ROWS, UNIT_FILES)
    assert [u.rows for u in default.units] == [100_000] and default.pinned == {}  # at the default: one unit, as before


def test_parts_of_a_folder_and_a_table_read_every_row_once(tmp_path: Path, ray_cluster) -> None:
    image = jpeg(np.random.default_rng(1).integers(0, 255, (20, 20, 3), dtype=np.uint8))
    folder = tmp_path / "pics"
    (folder / "a").mkdir(parents=True)
    for i in range(230):
        (folder / "a" / f"{i:04d}.jpg").write_bytes(image)
    (folder / "a" / "0007.txt").write_text("a sidecar caption")
    (folder / "b.jpg").write_bytes(image)
    spec = SourceSpec("pics", "imagefolder", str(folder))
    plan = plan_units(spec, None, UNIT_BYTES, UNIT_ROWS, 50)
    assert [u.rows for u in plan.units] == [1, 50, 50, 50, 50, 30]  # the root's one file, then `a` in 5 ranges
    keys = [r["source_key"] for u in plan.units for f in u.spec["fragments"]
            for b in read_fragment(spec, f, None, None, u.spec.get("part")) for r in b.to_pylist()]
    assert sorted(keys) == sorted(["b", *(f"a/{i:04d}" for i in range(230))])
    report = build_samples(spec, Storage(str(tmp_path / "corpus")), unit_files=50)
    assert (report.rows, report.rejected, report.units.units) == (231, 0, 6)

    table = tmp_path / "table"
    table.mkdir()
    pq.write_table(pa.table({"image": [image] * 1_000, "n": list(range(1_000))}), table / "t.parquet",
                   row_group_size=300)
    whole = SourceSpec("t", "parquet", str(table), image_column="image")
    path = str(table / "t.parquet")
    ranges = [(0, 300), (300, 450), (450, 1_000), (999, 1_000)]
    got = {a: [r["source_key"] for b in read_fragment(whole, path, None, None, (a, z)) for r in b.to_pylist()]
           for a, z in ranges}
    assert all(got[a] == [f"t:{i}" for i in range(a, z)] for a, z in ranges)


def test_a_big_folder_on_s3_is_read_in_name_ranges_many_files_at_once(s3_endpoint: dict, tmp_path: Path) -> None:
    """On an object store each unit reads its range `REMOTE_READS` files at a time; rows stay in
    name order and every file is read once."""
    import boto3
    import s3fs

    image = jpeg(np.random.default_rng(2).integers(0, 255, (20, 20, 3), dtype=np.uint8))
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(120):
        (root / f"{i:04d}.jpg").write_bytes(image)
    (root / "0042.txt").write_text("caption 42")
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="flat")
    s3fs.S3FileSystem(**s3_endpoint["storage_options"]).put(str(root), "flat/photos", recursive=True)
    spec, options = SourceSpec("flat", "imagefolder", "s3://flat/photos"), s3_endpoint["storage_options"]
    plan = plan_units(spec, options, UNIT_BYTES, UNIT_ROWS, 50)
    assert [(u.rows, u.spec["part"]) for u in plan.units] == [(50, [None, "0050.jpg"]), (50, ["0050.jpg", "0100.jpg"]),
                                                             (20, ["0100.jpg", None])]
    rows = [r for u in plan.units for b in read_fragment(spec, u.spec["fragments"][0], options, None, u.spec["part"])
            for r in b.to_pylist()]
    assert [r["source_key"] for r in rows] == [f"{i:04d}" for i in range(120)]
    assert all(r["image"] == image for r in rows) and rows[42]["caption"] == "caption 42"
