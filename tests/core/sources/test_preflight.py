"""`prx_core.sources.preflight`: the checks `prx-corpus build` makes before Ray starts (issue 27,
item 1), on real files of every format (parquet, an image folder, tar shards, a Hugging Face
Hub layout, a Lance dataset), local and on a loopback S3: each problem names the source, the
field and the fix; a good source gives none; a folder is looked into only as far as its first
files (a folder of thousands answers in milliseconds, and an inconclusive look is no problem)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import boto3
import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.sources.catalog import parse_catalog
from prx_core.sources.listing import first_files
from prx_core.sources.preflight import Problem, check_root, check_source, preflight
from prx_core.store.storage import Storage

JPEG = bytes.fromhex("ffd8ffe000104a46494600") + b"\0" * 32  # a name and bytes are all a listing sees


def spec(base: Path, **entry):
    return parse_catalog({"sources": [{"name": "src", **entry}]}, base_dir=base).sources[0]


def lines(problems: list[Problem]) -> list[str]:
    return [p.line() for p in problems]


def table(path: Path, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns or {"image": [JPEG], "caption": ["a cat"], "key": ["k0"]}), path)
    return path


def test_a_writable_root_passes_and_is_not_left_behind(tmp_path: Path) -> None:
    root = tmp_path / "new" / "corpus"
    assert check_root(Storage(str(root))) == []
    assert not (tmp_path / "new").exists(), "the probe's folders were left behind"


def test_an_unwritable_root_is_one_line_with_the_fix() -> None:
    (problem,) = check_root(Storage("/proc/prx-preflight/corpus"))
    assert problem.line().startswith("corpus root (--root): not writable: /proc/prx-preflight/corpus: ")
    assert "fix: give --root a folder" in problem.line()


def test_a_missing_uri_names_the_field_and_the_fix(tmp_path: Path) -> None:
    assert lines(check_source(spec(tmp_path, format="imagefolder", uri="nope"), None)) == [
        f"source 'src': field 'uri': {tmp_path}/nope does not exist; fix: point uri at the source's file or folder "
        "(a relative path resolves against the catalog's folder)"]


def test_parquet_columns_are_checked_against_the_first_file(tmp_path: Path) -> None:
    table(tmp_path / "t" / "part-0.parquet")
    good = spec(tmp_path, format="parquet", uri="t", image_column="image", caption_column="caption", key_column="key")
    assert check_source(good, None) == []
    assert check_source(spec(tmp_path, format="parquet", uri="t/part-0.parquet", image_column="image"), None) == []
    bad = spec(tmp_path, format="parquet", uri="t", image_column="jpg", caption_column="text",
               metadata_columns=["license"])
    assert [(p.field, p.problem.split(" is not")[0]) for p in check_source(bad, None)] == [
        ("image_column", "column 'jpg'"), ("caption_column", "column 'text'"), ("metadata_columns[0]", "column 'license'")]
    assert "(its columns: image, caption, key); fix: set image_column to one of its columns" in lines(check_source(bad, None))[0]


def test_a_folder_of_another_format_says_which_format_it_looks_like(tmp_path: Path) -> None:
    arrow = tmp_path / "saved"
    arrow.mkdir()
    with pa.OSFile(str(arrow / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("image", pa.binary())])) as writer:
            writer.write_table(pa.table({"image": [JPEG]}))
    (problem,) = check_source(spec(tmp_path, format="parquet", uri="saved", image_column="image"), None)
    assert problem.field == "uri" and "no .parquet file under" in problem.problem
    assert "use format: huggingface" in problem.problem and "fix: point uri" in problem.line()
    # the same folder read as what it is passes
    hf = spec(tmp_path, format="huggingface", uri="saved", image_column="image")
    assert check_source(hf, None) == []


def test_image_folders_and_tar_shards(tmp_path: Path) -> None:
    folder = tmp_path / "images" / "cats"
    folder.mkdir(parents=True)
    (folder / "a.jpg").write_bytes(JPEG)
    assert check_source(spec(tmp_path, format="imagefolder", uri="images"), None) == []
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("a caption without its image")
    (problem,) = check_source(spec(tmp_path, format="imagefolder", uri="texts"), None)
    assert problem.field == "uri" and "no image file (jpg, jpeg" in problem.problem and "1 .txt file" in problem.problem
    (tmp_path / "empty").mkdir()
    (problem,) = check_source(spec(tmp_path, format="webdataset", uri="empty"), None)
    assert "it holds no file" in problem.problem

    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "00000.tar", "w") as tar:
        info = tarfile.TarInfo("k0.jpg")
        info.size = len(JPEG)
        tar.addfile(info, io.BytesIO(JPEG))
    assert check_source(spec(tmp_path, format="webdataset", uri="shards"), None) == []
    (problem,) = check_source(spec(tmp_path, format="parquet", uri="shards", image_column="jpg"), None)
    assert "use format: webdataset" in problem.problem


def test_a_hub_layout_resolves_its_image_column_like_the_reader(tmp_path: Path) -> None:
    images = pa.array([{"bytes": JPEG, "path": "a.jpg"}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", image=images, text=["a cat"])
    (tmp_path / "hub" / "README.md").write_text("---\nlicense: cc0\n---\n")
    assert check_source(spec(tmp_path, format="huggingface", uri="hub"), None) == []
    table(tmp_path / "plain" / "data" / "train-00000-of-00001.parquet", url=["https://example.org/a.jpg"])
    (problem,) = check_source(spec(tmp_path, format="huggingface", uri="plain"), None)
    assert problem.field == "image_column" and "cannot tell the image column" in problem.problem
    assert problem.fix == "name the image column in the catalog (image_column: <column>)"


def test_lance_datasets_and_joined_tables(tmp_path: Path) -> None:
    lance.write_dataset(pa.table({"id": ["k0"], "image": [JPEG]}), str(tmp_path / "photos.lance"))
    assert check_source(spec(tmp_path, format="lance", uri="photos.lance", image_column="image"), None) == []
    (problem,) = check_source(spec(tmp_path, format="lance", uri="photos.lance", image_column="jpg"), None)
    assert (problem.field, problem.problem.split(" is not")[0]) == ("image_column", "column 'jpg'")
    (tmp_path / "notlance").mkdir()
    (tmp_path / "notlance" / "x.bin").write_bytes(b"x")
    (problem,) = check_source(spec(tmp_path, format="lance", uri="notlance", image_column="image"), None)
    assert problem.field == "uri" and "is not a Lance dataset" in problem.problem

    table(tmp_path / "caps" / "c.parquet", id=["k0"], caption=["a cat"])
    joined = spec(tmp_path, format="lance", uri="photos.lance", image_column="image", key_column="id",
                  joins=[{"uri": "caps", "key_column": "id", "caption_column": "text"},
                         {"uri": "missing.lance", "key_column": "id", "embedding_column": "clip"}])
    assert [(p.field, p.problem.split(" ")[0:2]) for p in check_source(joined, None)] == [
        ("joins[0].caption_column", ["column", "'text'"]), ("joins[1].uri", [f"{tmp_path}/missing.lance", "does"])]


def test_a_huge_folder_is_looked_into_only_as_far_as_its_first_files(tmp_path: Path) -> None:
    many = tmp_path / "many"
    many.mkdir()
    for i in range(2100):  # past the look's budget of 2000 entries
        os.close(os.open(many / f"{i:05d}.json", os.O_CREAT | os.O_WRONLY))
    (many / "sub").mkdir()
    table(many / "sub" / "part-0.parquet")
    look = first_files(str(many), lambda p: p.endswith(".parquet"))
    assert not look.exhaustive  # stopped after its budget of entries
    # inconclusive: no problem (the run's own listing decides), never a false "no .parquet file"
    assert check_source(spec(tmp_path, format="parquet", uri="many", image_column="image"), None) == []
    for i in range(3):
        (many / f"p{i}.jpg").write_bytes(JPEG)
    look = first_files(str(many), lambda p: p.endswith(".jpg"), budget=10_000)
    assert len(look.matches) == 3 and all(os.path.basename(m).startswith("p") for m in look.matches)


@pytest.fixture()
def bucket(s3_endpoint: dict) -> tuple[str, dict]:
    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1")
    client.create_bucket(Bucket="preflight")
    buffer = io.BytesIO()
    pq.write_table(pa.table({"image": [JPEG], "caption": ["a cat"]}), buffer)
    client.put_object(Bucket="preflight", Key="src/part-0.parquet", Body=buffer.getvalue())
    client.put_object(Bucket="preflight", Key="src/README.md", Body=b"hi")
    return "s3://preflight", s3_endpoint["storage_options"]


def test_on_s3_the_same_checks_answer_from_one_listing(bucket: tuple[str, dict], tmp_path: Path) -> None:
    base, options = bucket
    good = spec(tmp_path, format="parquet", uri=f"{base}/src", image_column="image", caption_column="caption")
    lost = spec(tmp_path, format="parquet", uri=f"{base}/nope", image_column="image")
    wrong = spec(tmp_path, format="parquet", uri=f"{base}/src", image_column="jpg")
    assert preflight(Storage(f"{base}/corpus", options), [good]) == []
    assert lines(preflight(Storage(f"{base}/corpus", options), [lost])) == [
        f"source 'src': field 'uri': {base}/nope does not exist; fix: point uri at the source's file or folder "
        "(a relative path resolves against the catalog's folder)"]
    (problem,) = check_source(wrong, options)
    assert problem.field == "image_column" and f"{base}/src/part-0.parquet (its columns: image, caption)" in problem.problem
    (problem,) = preflight(Storage("s3://no-such-bucket/corpus", options), [], check_sources=False)
    assert problem.subject == "corpus root (--root)" and "not writable: s3://no-such-bucket/corpus" in problem.problem
