"""Sources as users hold them, written by the real tools, through `prx-corpus build` into MDS.

One build over eleven small sources (`real_sources.py`: `datasets` parquet / Hub layout /
`save_to_disk`, the HF `imagefolder` convention, `webdataset`, `lancedb`, a three-table join, a
LAION-style URL table and `img2dataset`'s tar and parquet output, both fetched from a loopback
HTTP server this test runs), materializing `samples`, `buckets`, `captions` and `mds_shards`.
Every planted photo must reach its source's MDS streams with its caption; what cannot be
fetched must be a reject with its cause. Everything is read back with plain pylance and
mosaicml-streaming, never through the pipeline's readers.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import lance
import pytest
import real_sources as rs
import yaml
from test_build import build_args, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # the downloader tests' loopback server
from http_server import serving  # noqa: E402

pytestmark = pytest.mark.slow

SELECT = "raw_source,samples,buckets,captions,mds_shards"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("real")
    sources = base / "sources"
    sources.mkdir()
    with serving({}) as server:
        def publish(name: str, data: bytes) -> str:
            server.photos[name] = data
            return server.url(f"/photo/{name}/{name}.jpg")

        def missing(name: str) -> str:
            return server.url(f"/missing/{name}.jpg")

        written = [
            rs.write_hf_parquet(sources, rs.photos(4, 0)), rs.write_hf_hub(sources, rs.photos(4, 1)),
            rs.write_hf_disk(sources, rs.photos(3, 2)), rs.write_imagefolder(sources, rs.photos(4, 3)),
            rs.write_webdataset(sources, rs.photos(4, 4)), rs.write_lancedb(sources, rs.photos(3, 5)),
            rs.write_joined(sources, rs.photos(4, 6)), rs.write_url_table(sources, rs.photos(4, 7), publish, missing),
            rs.write_img2dataset(sources, rs.photos(3, 8), publish, missing, "webdataset"),
            rs.write_img2dataset(sources, rs.photos(3, 9), publish, missing, "parquet"),
        ]
        catalog = sources / "sources.yaml"
        catalog.write_text(yaml.safe_dump({"sources": [w.entry for w in written]}, sort_keys=False))
        root = base / "corpus"
        config = base / "config.yaml"  # small units: the sources are tiny
        config.write_text(yaml.safe_dump({"units": {"samples_bytes": 1 << 20}}))
        run = run_cli(*build_args(catalog, root, base / "dagster", "--select", SELECT, "--config", str(config)),
                      timeout=1500)
        fetched = Counter(r.path for r in server.log)
        plan = run_cli("plan", "--sources", str(catalog), "--json", str(base / "plan.json"), timeout=600)
    return {"run": run, "root": root, "written": {w.entry["name"]: w for w in written}, "fetched": fetched,
            "plan": plan, "planned": json.loads((base / "plan.json").read_text()) if plan.returncode == 0 else {}}


def table(root: Path, name: str, source: str, columns: list[str]) -> list[dict]:
    ds = lance.dataset(str(root / "lance" / f"{name}.lance"))
    return ds.to_table(columns=columns, filter=f"source = '{source}'").to_pylist()


def test_every_form_builds(built) -> None:
    assert built["run"].returncode == 0, built["run"].explain()
    # preflight says what the URL table may reach: it opted in to the loopback server only
    assert "source 'laion': fetches http(s) from public addresses and 127.0.0.1/32; no object-store URLs; no local " \
           "files; X-Robots-Tag opt-outs for prx-corpus, img2dataset honoured" in built["run"].stdout


@pytest.mark.parametrize("source", ["hf_parquet", "hf_hub", "hf_disk", "folder", "wds", "lancedb_photos", "joined",
                                    "laion", "i2d_webdataset", "i2d_parquet"])
def test_each_source_reaches_mds_with_its_captions(built, source: str) -> None:
    from streaming import Stream, StreamingDataset

    root, planted = built["root"], built["written"][source].captions
    samples = table(root, "samples", source, ["sample_id", "original_caption", "metadata", "source_url"])
    assert sorted(s["original_caption"] for s in samples) == sorted(planted), built["run"].explain()
    streams = [Stream(local=str(index.parent)) for index in sorted((root / "mds" / source).glob("*/*/index.json"))]
    dataset = StreamingDataset(streams=streams, batch_size=1, shuffle=False)  # one dataset: ~36 descriptors
    read = [dataset[i]["caption"] for i in range(dataset.num_samples)]
    assert sorted(read) == sorted(planted)


def test_fetched_sources_keep_their_url_and_metadata_and_reject_what_failed(built) -> None:
    root = built["root"]
    laion = table(root, "samples", "laion", ["source_url", "metadata"])
    assert all(s["source_url"] and "/photo/laion_" in s["source_url"] for s in laion)
    assert all({"WIDTH", "HEIGHT", "similarity"} <= dict(s["metadata"]).keys() for s in laion)
    for source in ("laion", "i2d_parquet"):
        rejects = table(root, "rejects", source, ["reason", "message"])
        assert [r["reason"] for r in rejects] == ["download_error"], (source, rejects)
        assert "404" in rejects[0]["message"], rejects
    assert all(n == 1 for path, n in built["fetched"].items() if "/photo/laion_" in path)  # fetched once each


def test_labels_and_joined_fields_arrive_as_metadata(built) -> None:
    root = built["root"]
    folder = table(root, "samples", "folder", ["source_key", "metadata"])
    assert {dict(s["metadata"] or {}).get("license") for s in folder} == {"cc0-1.0"}
    assert {s["source_key"].split("/")[1] for s in folder} == {"cat", "dog"}  # train/cat/<stem>
    wds = table(root, "samples", "wds", ["metadata"])
    assert {dict(s["metadata"] or {}).get("label") for s in wds} == {"0", "1", "2"}
    joined = table(root, "samples", "joined", ["embedding", "metadata"])
    assert all(s["embedding"] is not None and len(s["embedding"]) == 8 for s in joined)
    assert all(dict(s["metadata"]).get("license") == "cc-by-4.0" for s in joined)


def test_the_summary_has_a_row_per_source(built) -> None:
    out = built["run"].stdout
    for source in built["written"]:
        assert any(line.split()[:1] == [source] for line in out.splitlines()), (source, out)


def test_the_plan_reads_every_form_and_foresees_the_build(built) -> None:
    """`prx-corpus plan` over the same catalog (its sources are smaller than the sample, so it reads
    every record, fetching the URL tables' images): rows and MDS samples as the build made them."""
    assert built["plan"].returncode == 0, built["plan"].explain()
    root, planned = built["root"], {p["source"]: p for p in built["planned"]["sources"]}
    assert sorted(planned) == sorted(built["written"])
    for source, plan in planned.items():
        rows = len(table(root, "samples", source, ["sample_id"])) + len(
            [r for r in table(root, "rejects", source, ["stage"]) if r["stage"] == "samples"])
        written = len(table(root, "mds_index", source, ["sample_id"]))
        assert (plan["rows"], plan["rows_from"], plan["mds_samples"]) == (rows, "every record read", written), source
