"""Fetching limited by default (issue 44, item 5), against the loopback server: a URL table reaches
public http(s) hosts and its own objects only, unless its catalog entry opts in. Loopback by
address and by name, a redirect to another non-public address, local files, objects outside the
source's uri are `url_not_allowed` rejects (never requested); opted in to one network, only that
network. A reject message never carries the file's bytes; `X-Robots-Tag` addressed to img2dataset
is honoured; preflight's line says what a source may reach."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from http_server import PhotoServer
from test_download import FAST, LOOPBACK, records, spec_for, url_table

from prx_core.sources.catalog import DownloadSettings, SourceSpec
from prx_core.sources.fetch.policy import FetchPolicy
from prx_core.sources.ingest import inspect_image
from prx_core.sources.readers import read_source

DEFAULT = replace(FAST, allow_networks=())  # FAST's timeouts, the default reach


def test_loopback_is_refused_by_default_by_address_and_by_name(tmp_path: Path, photo_server: PhotoServer) -> None:
    port = photo_server.server_address[1]
    rows = [{"key": "ip", "URL": photo_server.url("/photo/astronaut/policy-ip"), "TEXT": "t"},
            {"key": "name", "URL": f"http://localhost:{port}/photo/coffee/policy-name", "TEXT": "t"}]
    url_table(tmp_path / "t", [rows])
    photo_server.clear()
    got = records(spec_for(tmp_path / "t", DEFAULT))
    assert {k: r["reject_reason"] for k, r in got.items()} == {"ip": "url_not_allowed", "name": "url_not_allowed"}
    assert got["ip"]["reject_message"].startswith("127.0.0.1 is a loopback address, not fetched (download.allow_"
                                                  "networks allows non-public networks for this source)")
    assert got["name"]["reject_message"].startswith("localhost resolves to ")
    assert "loopback address, not fetched" in got["name"]["reject_message"]
    assert photo_server.paths() == []  # nothing was asked for


def test_opted_in_to_one_network_a_redirect_elsewhere_is_refused(tmp_path: Path, photo_server: PhotoServer,
                                                                 served_photos: dict[str, bytes]) -> None:
    targets = {"same": "127.0.0.1", "other_loopback": "127.0.0.2", "metadata": "169.254.169.254", "v6": "[::1]"}
    rows = [{"key": k, "URL": photo_server.url(f"/to-host/{host}/astronaut/{k}"), "TEXT": "t"} for k, host in targets.items()]
    url_table(tmp_path / "t", [rows])
    got = records(spec_for(tmp_path / "t", replace(FAST, allow_networks=LOOPBACK)))
    assert got["same"]["reject_reason"] is None and got["same"]["image"] == served_photos["astronaut"]
    for key, kind in (("other_loopback", "loopback"), ("metadata", "link-local"), ("v6", "loopback")):
        assert got[key]["reject_reason"] == "url_not_allowed", got[key]
        assert got[key]["reject_message"].startswith(f"redirected to http://{targets[key]}:"), got[key]
        assert f"{targets[key].strip('[]')} is a {kind} address, not fetched" in got[key]["reject_message"]


def test_local_files_and_other_objects_are_refused_unless_allowed(tmp_path: Path, served_photos: dict[str, bytes]) -> None:
    (tmp_path / "a.jpg").write_bytes(served_photos["astronaut"])
    rows = [{"key": "path", "URL": str(tmp_path / "a.jpg"), "TEXT": "t"},
            {"key": "file", "URL": f"file://{tmp_path / 'a.jpg'}", "TEXT": "t"},
            {"key": "object", "URL": "s3://someone-elses-bucket/secret.jpg", "TEXT": "t"}]
    url_table(tmp_path / "t", [rows])
    got = records(spec_for(tmp_path / "t", DEFAULT))
    assert {k: r["reject_reason"] for k, r in got.items()} == dict.fromkeys(rows_keys(rows), "url_not_allowed")
    assert got["path"]["reject_message"].startswith("a local file, not fetched (download.allow_files: true")
    assert got["object"]["reject_message"].startswith("an object outside the source's uri (not an object store), "
                                                      "not fetched (download.allow_object_prefixes")
    allowed = records(spec_for(tmp_path / "t", replace(DEFAULT, allow_files=True)))
    assert allowed["path"]["image"] == allowed["file"]["image"] == served_photos["astronaut"]
    assert allowed["object"]["reject_reason"] == "url_not_allowed"


def rows_keys(rows: list[dict]) -> list[str]:
    return [r["key"] for r in rows]


def test_an_image_column_path_on_an_object_store_stays_under_the_sources_uri() -> None:
    policy = FetchPolicy(DownloadSettings(), "s3://corpus-bucket/hf/data")
    assert policy.refusal("s3://corpus-bucket/hf/data/images/0.jpg") is None
    assert policy.refusal("s3://corpus-bucket/hf/data-other/0.jpg") is not None  # a sibling prefix, not under
    assert policy.refusal("s3://corpus-bucket/private/keys.json").startswith("an object outside the source's "
                                                                            "s3://corpus-bucket/hf/data/")
    wider = FetchPolicy(DownloadSettings(allow_object_prefixes=("s3://corpus-bucket/images/",)), "s3://corpus-bucket/hf")
    assert wider.refusal("s3://corpus-bucket/images/1.jpg") is None and wider.refusal("s3://x/y") is not None


def test_a_hf_image_path_url_follows_the_same_policy(tmp_path: Path, photo_server: PhotoServer) -> None:
    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image() layout
    paths = [photo_server.url("/photo/coffee/hf-policy"), "s3://someone-elses-bucket/x.jpg"]
    table = pa.table({"image": pa.array([{"bytes": None, "path": p} for p in paths], image_struct), "text": ["a", "b"]})
    pq.write_table(table, tmp_path / "urls.parquet")
    spec = SourceSpec("urls", "parquet", str(tmp_path), image_column="image", caption_column="text")
    got = [r for batch in read_source(spec) for r in batch.to_pylist()]
    assert [r["reject_reason"] for r in got] == ["url_not_allowed", "url_not_allowed"]


def test_a_reject_message_never_carries_the_files_bytes() -> None:
    secret = b"root:x:0:0:root:/root:/bin/bash\n"
    refusal = inspect_image(secret)
    assert refusal.reason == "not_an_image" and refusal.message == f"not a recognised image ({len(secret)} bytes: text)"
    assert "root" not in refusal.message and "\\x" not in inspect_image(b"\x00\x01secret\xff" * 9).message


def test_opt_outs_addressed_to_img2dataset_are_honoured(tmp_path: Path, photo_server: PhotoServer,
                                                       served_photos: dict[str, bytes]) -> None:
    url_table(tmp_path / "t", [[{"key": "a", "URL": photo_server.url("/i2d/rocket/policy"), "TEXT": "t"}]])
    (record,) = records(spec_for(tmp_path / "t")).values()
    assert (record["reject_reason"], record["reject_message"].split(": http")[0]) == (
        "opted_out", "X-Robots-Tag: img2dataset: noai")
    (kept,) = records(spec_for(tmp_path / "t", replace(FAST, opt_out_agents=()))).values()
    assert kept["reject_reason"] is None and kept["image"] == served_photos["rocket"]


def test_preflight_says_what_a_source_may_reach() -> None:
    assert FetchPolicy(DownloadSettings(), "/data/laion").describe() == (
        "fetches http(s) from public addresses only; no object-store URLs; no local files; X-Robots-Tag opt-outs for "
        "prx-corpus, img2dataset honoured")
    opted = DownloadSettings(allow_networks=("10.0.0.0/8",), allow_files=True, allow_object_prefixes=("*",))
    assert FetchPolicy(opted, "s3://b/laion").describe().startswith(
        "fetches http(s) from public addresses and 10.0.0.0/8; any object the credentials reach; local files;")


def test_a_source_refused_for_what_it_may_reach_says_which_setting_allows_it() -> None:
    from prx_core.stages.samples.refusals import refused_line

    line = refused_line(spec_for(Path("/laion")), {"url_not_allowed": 2}, {})
    assert "url_not_allowed 2" in line and "allow_networks, allow_object_prefixes, allow_files" in line
