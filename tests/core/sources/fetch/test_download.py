"""Metadata-only sources (`url_column`): every fetch outcome against a loopback HTTP server with
real photos and each failure a server can give, S3 keys on the loopback S3 endpoint, local paths,
the real `samples` stage on local Ray, and a killed download run that resumes without refetching
the units it recorded (the server's request log says what was fetched)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from crash import kill_at, recorded_units
from http_server import PhotoServer, load_photos

from prx_core.sources.catalog import DownloadSettings, SourceSpec
from prx_core.sources.fetch.download import url_metadata_columns
from prx_core.sources.fetch.robots import opt_out
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.samples.units import group_fragments
from prx_core.store import lance_io
from prx_core.store.storage import Storage

LOOPBACK = ("127.0.0.1/32",)  # the test server's network: a source must opt in to reach it (fetch.policy)
FAST = DownloadSettings(read_timeout_s=0.5, backoff_s=0.05, retries=2, allow_networks=LOOPBACK)
CAP = 1 << 20  # under BIG_BYTES


def url_table(folder: Path, files: list[list[dict]], name: str = "part") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n, rows in enumerate(files):
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}-{n:05d}.parquet")


def spec_for(folder: Path, settings: DownloadSettings = FAST, **fields) -> SourceSpec:
    return SourceSpec("laion", "parquet", str(folder), url_column="URL", caption_column="TEXT", key_column="key",
                      max_image_bytes=CAP, download=settings, **fields)


def records(spec: SourceSpec, storage_options: dict | None = None) -> dict[str, dict]:
    """Every record the source's files give, by key (the reader's pipeline, in this process)."""
    out = {}
    for fragment in [f for f, _ in fragment_sizes(spec, storage_options)]:
        for batch in read_fragment(spec, fragment, storage_options):
            out.update({r["source_key"]: r for r in batch.to_pylist()})
    return out


OUTCOMES = {  # path -> (reason, what the message says besides the URL)
    "/photo/astronaut/ok": (None, ""),
    "/redirect/coffee/ok": (None, ""),
    "/otherbot/chelsea/ok": (None, ""),  # scoped to another agent: not ours
    "/missing/x": ("download_error", "HTTP 404"),
    "/slow/x": ("download_timeout", "no data for 0.5 s"),
    "/big/x": ("image_too_large", "Content-Length 2097152"),
    "/big-unsized/x": ("image_too_large", "no Content-Length"),
    "/loop/a": ("download_error", "redirect loop"),
    "/to-file/x": ("download_error", "non-http(s) URL refused: file:///etc/passwd"),
    "/noai/rocket/x": ("opted_out", "X-Robots-Tag: noai"),
    "/ours/rocket/x": ("opted_out", "X-Robots-Tag: prx-corpus: noimageai"),
    "/throttle-long/x": ("download_error", "Retry-After 3600 s over the 30 s"),
    "/page/x": ("download_error", "HTTP 200 with Content-Type text/html; charset=utf-8, not an image"),
}


def test_each_outcome_of_a_fetch_is_its_image_or_its_reject(tmp_path: Path, photo_server: PhotoServer,
                                                             served_photos: dict[str, bytes]) -> None:
    rows = [{"key": f"k{i}", "URL": photo_server.url(path), "TEXT": f"caption {i}"} for i, path in enumerate(OUTCOMES)]
    url_table(tmp_path / "table", [rows])
    started = time.monotonic()
    got = records(spec_for(tmp_path / "table"))
    assert time.monotonic() - started < 10  # the slow body did not hold the batch for its 3 s, nor 3600 s waited
    for i, (path, (reason, says)) in enumerate(OUTCOMES.items()):
        record = got[f"k{i}"]
        assert record["reject_reason"] == reason, (path, record["reject_message"])
        assert record["source_url"] == photo_server.url(path)
        if reason is None:
            assert record["image"] == served_photos[path.split("/")[2]] and record["caption"] == f"caption {i}"
        else:
            assert says in record["reject_message"] and photo_server.url(path) in record["reject_message"], path
            assert not record["image"] and len(record["reject_message"]) <= 300
    assert {r.user_agent for r in photo_server.log} == {FAST.user_agent} and FAST.user_agent.startswith("prx-corpus/")


def test_a_row_without_a_url_is_a_download_error_naming_the_column(tmp_path: Path, photo_server: PhotoServer) -> None:
    rows = [{"key": "none", "URL": None, "TEXT": "a"}, {"key": "blank", "URL": "  ", "TEXT": "b"},
            {"key": "ok", "URL": photo_server.url("/photo/astronaut/n"), "TEXT": "c"}]
    url_table(tmp_path / "table", [rows])
    photo_server.clear()
    got = records(spec_for(tmp_path / "table"))
    for key in ("none", "blank"):
        assert got[key]["reject_reason"] == "download_error" and "url column 'URL' is null or empty" in \
            got[key]["reject_message"]
    assert got["ok"]["reject_reason"] is None and [r.path for r in photo_server.log] == ["/photo/astronaut/n"]


def test_429_5xx_and_dropped_connections_are_retried_with_backoff(tmp_path: Path, photo_server: PhotoServer,
                                                                  served_photos: dict[str, bytes]) -> None:
    paths = ["/flaky/astronaut/r", "/drop/coffee/r", "/throttle/chelsea/r"]
    url_table(tmp_path / "table", [[{"key": p, "URL": photo_server.url(p), "TEXT": "t"} for p in paths]])
    got = records(spec_for(tmp_path / "table"))
    assert [got[p]["image"] for p in paths] == [served_photos["astronaut"], served_photos["coffee"], served_photos["chelsea"]]
    log = [r for r in photo_server.log if r.path in paths]
    assert sorted(r.path for r in log) == sorted(paths * 2)  # one failure, one success each
    throttled = [r.at for r in log if r.path == paths[2]]
    assert throttled[1] - throttled[0] >= 0.95  # Retry-After: 1 waited, not the 0.05 s backoff
    flaky = [r.at for r in log if r.path == paths[0]]
    assert flaky[1] - flaky[0] >= 0.05


def test_retries_give_up_with_the_last_status(tmp_path: Path, photo_server: PhotoServer) -> None:
    url = photo_server.url("/fail/always")
    url_table(tmp_path / "table", [[{"key": "a", "URL": url, "TEXT": "t"}]])
    settings = DownloadSettings(backoff_s=0.01, retries=2, allow_networks=LOOPBACK)
    (record,) = records(spec_for(tmp_path / "table", settings)).values()
    assert record["reject_reason"] == "download_error"
    assert record["reject_message"] == f"HTTP 503 Service Unavailable after 3 attempts: {url}"
    assert photo_server.paths().count("/fail/always") == 3


def test_requests_in_flight_stay_within_concurrency_and_per_host(tmp_path: Path, photo_server: PhotoServer) -> None:
    port = photo_server.server_address[1]
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}"]
    rows = [{"key": f"k{i}", "URL": f"http://{hosts[i % 2]}/hold/astronaut/{i}", "TEXT": "t"} for i in range(16)]
    url_table(tmp_path / "table", [rows])
    settings = DownloadSettings(concurrency=5, per_host=3, allow_networks=LOOPBACK)
    started = time.monotonic()
    got = records(spec_for(tmp_path / "table", settings))
    assert all(r["reject_reason"] is None for r in got.values())
    assert photo_server.peak[hosts[0]] == photo_server.peak[hosts[1]] == 3  # reached, never passed
    assert photo_server.peak[""] == 5
    assert time.monotonic() - started >= 16 / 5 * 0.3 * 0.9  # what the bound costs: it really held


def test_opt_outs_are_read_as_documented() -> None:
    ours = "prx-corpus"
    for refused in ("noai", "NoImageAI", "noindex", "noimageindex", "none", "noarchive, noai",
                    "prx-corpus: noai", "noindex, unavailable_after: 25 Jun 2030 15:00:00 PST"):
        assert opt_out([refused], ours), refused
    for allowed in ("otherbot: noai", "nofollow", "noarchive, nosnippet", "max-image-preview: large",
                    "unavailable_after: 25 Jun 2030 15:00:00 PST", ""):
        assert opt_out([allowed], ours) is None, allowed
    assert opt_out(["nofollow", "otherbot: none", "noimageai"], ours) == "noimageai"  # every header counts


def test_opt_outs_are_ignored_when_the_catalog_says_so(tmp_path: Path, photo_server: PhotoServer,
                                                       served_photos: dict[str, bytes]) -> None:
    url_table(tmp_path / "table", [[{"key": "a", "URL": photo_server.url("/noai/rocket/ignored"), "TEXT": "t"}]])
    settings = DownloadSettings(honor_opt_out=False, allow_networks=LOOPBACK)
    (record,) = records(spec_for(tmp_path / "table", settings)).values()
    assert record["reject_reason"] is None and record["image"] == served_photos["rocket"]


def test_a_long_url_is_named_in_a_message_under_300_characters(tmp_path: Path, photo_server: PhotoServer) -> None:
    url = photo_server.url("/missing/" + "a" * 400 + "/tail.jpg")
    url_table(tmp_path / "table", [[{"key": "a", "URL": url, "TEXT": "t"}]])
    (record,) = records(spec_for(tmp_path / "table")).values()
    message = record["reject_message"]
    assert len(message) <= 300 and message.startswith("HTTP 404 Not Found: http://127.0.0.1:")
    assert message.endswith("/tail.jpg") and "..." in message and record["source_url"] == url


def test_url_tables_keep_their_descriptive_columns_as_metadata() -> None:
    spec = SourceSpec("laion", "parquet", "/x", url_column="URL", caption_column="TEXT", key_column="key")
    names = ["key", "URL", "TEXT", "WIDTH", "HEIGHT", "similarity", "punsafe", "pwatermark", "LICENSE", "NSFW",
             "hash", "clip_l14_similarity_score", "original_width", "status", "face_bboxes"]
    assert url_metadata_columns(spec, names) == ["WIDTH", "HEIGHT", "similarity", "punsafe", "pwatermark", "LICENSE",
                                                 "NSFW", "hash", "clip_l14_similarity_score", "original_width"]
    by_width = SourceSpec("x", "parquet", "/x", url_column="url", caption_column="width")
    assert url_metadata_columns(by_width, ["url", "width", "height"]) == ["height"]  # never a column read otherwise


def test_local_paths_and_file_urls_are_read_under_the_size_cap(tmp_path: Path, served_photos: dict[str, bytes]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.jpg").write_bytes(served_photos["astronaut"])
    (tmp_path / "img" / "big.bin").write_bytes(b"\0" * (CAP + 1))
    rows = [{"key": "path", "URL": str(tmp_path / "img" / "a.jpg"), "TEXT": "t"},
            {"key": "file_url", "URL": f"file://{tmp_path / 'img' / 'a.jpg'}", "TEXT": "t"},
            {"key": "missing", "URL": str(tmp_path / "img" / "gone.jpg"), "TEXT": "t"},
            {"key": "big", "URL": str(tmp_path / "img" / "big.bin"), "TEXT": "t"},
            {"key": "relative", "URL": "img/a.jpg", "TEXT": "t"},
            {"key": "folder", "URL": str(tmp_path / "img"), "TEXT": "t"}]
    url_table(tmp_path / "table", [rows])
    got = records(spec_for(tmp_path / "table", replace(FAST, allow_files=True)))
    assert got["path"]["image"] == got["file_url"]["image"] == served_photos["astronaut"]
    assert {k: got[k]["reject_reason"] for k in ("missing", "big", "relative", "folder")} == {
        "missing": "download_error", "big": "image_too_large", "relative": "download_error", "folder": "download_error"}
    assert got["missing"]["reject_message"] == f"no such object or file: {tmp_path / 'img' / 'gone.jpg'}"
    assert "absolute path" in got["relative"]["reject_message"]


def test_a_table_of_s3_keys_is_fetched_from_the_object_store(tmp_path: Path, s3_endpoint: dict,
                                                             served_photos: dict[str, bytes]) -> None:
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1")
    client.create_bucket(Bucket="url-keys")
    for name in ("astronaut", "coffee"):
        client.put_object(Bucket="url-keys", Key=f"images/{name}.jpg", Body=served_photos[name])
    client.put_object(Bucket="url-keys", Key="images/huge.jpg", Body=b"\xff" * (CAP + 10))
    rows = [{"key": n, "URL": f"s3://url-keys/images/{n}.jpg", "TEXT": n}
            for n in ("astronaut", "coffee", "huge", "gone")]
    table = pa.Table.from_pylist(rows)
    with pa.BufferOutputStream() as sink:
        pq.write_table(table, sink)
    client.put_object(Bucket="url-keys", Key="table/part-0.parquet", Body=sink.getvalue().to_pybytes())
    spec = SourceSpec("keys", "parquet", "s3://url-keys/table", url_column="URL", caption_column="TEXT",
                      key_column="key", max_image_bytes=CAP,
                      download=DownloadSettings(allow_object_prefixes=("s3://url-keys/images/",)))
    got = records(spec, s3_endpoint["storage_options"])
    assert got["astronaut"]["image"] == served_photos["astronaut"] and got["coffee"]["image"] == served_photos["coffee"]
    assert got["astronaut"]["source_url"] == "s3://url-keys/images/astronaut.jpg"
    assert (got["huge"]["reject_reason"], got["gone"]["reject_reason"]) == ("image_too_large", "download_error")
    assert got["gone"]["reject_message"] == "no such object or file: s3://url-keys/images/gone.jpg"


def stage_rows(photo_server: PhotoServer) -> list[list[dict]]:
    """Two files of a LAION-like table: URL, TEXT, WIDTH, HEIGHT, similarity, punsafe."""
    paths = [["/photo/astronaut/s", "/redirect/coffee/s", "/missing/s", "/noai/rocket/s"],
             ["/photo/chelsea/s", "/flaky/motorcycle_left/s", "/slow/s", "/big/s"]]
    return [[{"key": f"f{f}r{r}", "URL": photo_server.url(p), "TEXT": f"a photo {f} {r}", "WIDTH": 480 + r, "HEIGHT": 320,
              "similarity": 0.25 + r / 100, "punsafe": 0.01} for r, p in enumerate(file)]
            for f, file in enumerate(paths)]


def test_the_samples_stage_fetches_keeps_urls_and_metadata_and_rejects_each_failure(
        tmp_path: Path, photo_server: PhotoServer, ray_cluster) -> None:
    files = stage_rows(photo_server)
    url_table(tmp_path / "laion", files)
    storage = Storage(str(tmp_path / "corpus"))
    report = build_samples(spec_for(tmp_path / "laion"), storage, unit_bytes=1)
    assert (report.units.units, report.rows, report.rejected) == (2, 4, 4)
    samples = lance_io.read_table(storage.lance_uri("samples"), ["source_key", "source_url", "metadata", "width"])
    by_key = {r["source_key"]: r for r in samples.to_pylist()}
    rows = {r["key"]: r for file in files for r in file}
    assert sorted(by_key) == ["f0r0", "f0r1", "f1r0", "f1r1"]
    for key, sample in by_key.items():
        assert sample["source_url"] == rows[key]["URL"]
        assert dict(sample["metadata"]) == {"WIDTH": str(rows[key]["WIDTH"]), "HEIGHT": "320",
                                            "similarity": str(rows[key]["similarity"]), "punsafe": "0.01"}
    assert by_key["f0r0"]["width"] == 480  # measured from the fetched photo, the table's WIDTH kept beside it
    rejects = lance_io.read_table(storage.lance_uri("rejects"), ["source_key", "stage", "reason", "message"])
    got = {r["source_key"]: (r["reason"], r["message"]) for r in rejects.to_pylist()}
    assert {k: reason for k, (reason, _) in got.items()} == {
        "f0r2": "download_error", "f0r3": "opted_out", "f1r2": "download_timeout", "f1r3": "image_too_large"}
    assert all(message.endswith(rows[key]["URL"]) for key, (_, message) in got.items())
    assert set(rejects["stage"].to_pylist()) == {"samples"}


RESUME = """
import json, ray, sys
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
build_samples(SourceSpec.from_dict(json.loads(sys.argv[3])), Storage(sys.argv[1]), unit_bytes=1)
"""


def test_a_killed_download_resumes_without_refetching_its_recorded_units(
        tmp_path: Path, photo_server: PhotoServer, ray_cluster) -> None:
    names = list(load_photos())
    files = [[{"key": f"f{f}r{r}", "URL": photo_server.url(f"/photo/{names[(f + r) % len(names)]}/resume-f{f}r{r}"),
               "TEXT": f"photo {f} {r}"} for r in range(3)] for f in range(5)]
    url_table(tmp_path / "laion", files)
    spec, root = spec_for(tmp_path / "laion"), str(tmp_path / "corpus")
    kill_at("samples:units:2", RESUME, root, ray_cluster.get_runtime_context().gcs_address, json.dumps(spec.to_dict()))
    recorded = recorded_units(root, "samples", "laion")
    photo_server.clear()
    report = build_samples(spec, Storage(root), unit_bytes=1)
    assert len(recorded) >= 2 and report.units.skipped == len(recorded) and report.units.ran == 5 - len(recorded)
    assert report.rows == 15 and report.rejected == 0
    units = {u.id: u.spec["fragments"] for u in group_fragments(fragment_sizes(spec), 1)}
    recorded_urls = {row["URL"] for unit in recorded for fragment in units[unit]
                     for row in pq.read_table(fragment).to_pylist()}
    fetched = {photo_server.url(path) for path in photo_server.paths()}
    assert len(recorded_urls) == 3 * len(recorded) and not recorded_urls & fetched
    assert fetched == {row["URL"] for file in files for row in file} - recorded_urls  # the rest


def test_download_settings_come_from_the_catalog_and_wrong_ones_name_the_field(tmp_path: Path) -> None:
    from prx_core.sources.catalog import CatalogError, parse_catalog

    entry = {"name": "laion", "format": "parquet", "uri": "laion/", "url_column": "URL", "caption_column": "TEXT",
             "download": {"concurrency": 32, "per_host": 2, "read_timeout_s": 5, "max_redirects": 0, "retries": 0,
                          "honor_opt_out": False, "user_agent": "prx-corpus/0.1 (+https://example.org/bot)"}}
    (spec,) = parse_catalog({"sources": [entry]}, tmp_path).sources
    assert spec.download == DownloadSettings(concurrency=32, per_host=2, read_timeout_s=5.0, max_redirects=0, retries=0,
                                             honor_opt_out=False, user_agent=entry["download"]["user_agent"])
    assert SourceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec  # what a worker reads back
    for setting, value in (("per_host", 0), ("attempt_timeout_s", -1), ("concurrency", 1.5), ("honor_opt_out", "no"),
                           ("user_agent", " "), ("redirects", 3)):
        with pytest.raises(CatalogError, match=f"source 'laion': field 'download.{setting}'"):
            parse_catalog({"sources": [{**entry, "download": {setting: value}}]}, tmp_path)


def test_a_fetch_from_inside_a_running_event_loop_runs_its_own(photo_server: PhotoServer, served_photos: dict[str, bytes]) -> None:
    import asyncio

    from prx_core.sources.fetch.window import fetch_http

    async def caller() -> list:  # as an async Ray actor would call it
        return fetch_http([photo_server.url("/photo/coffee/in-loop")], FAST, CAP)

    (fetched,) = asyncio.run(caller())
    assert fetched.data == served_photos["coffee"]
