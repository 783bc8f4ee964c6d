"""Captions where users keep them (issue 22, item 4): WebDataset JSON members and `.cls` labels,
written by the real `webdataset` package; HF `imagefolder` metadata files and class folders,
cross-checked against what `datasets.load_dataset("imagefolder")` itself yields for the same
tree (offline); and both through the real `samples` stage on a local Ray."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import tarfile
from pathlib import Path

import lance
import pytest
import webdataset as wds
from PIL import Image

from prx_core.sources.catalog import CatalogError, SourceSpec, parse_catalog
from prx_core.sources.folders import metadata as folder_metadata
from prx_core.sources.readers import RECORD_SCHEMA, read_source
from prx_core.stages.samples.stage import build_samples
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # HF's builder runs on local files only (HF_HUB_OFFLINE: conftest)

PHOTO_FILES = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png", "camera.png")


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Real photos (scikit-image's samples) downscaled to ~500 px, as JPEG."""
    from prx_core.demo.photos import skimage_data_dir

    out = []
    for name in PHOTO_FILES:
        image = Image.open(skimage_data_dir() / name).convert("RGB")
        image.thumbnail((500, 500))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=88)
        out.append(buffer.getvalue())
    return out


def rows(spec: SourceSpec) -> dict[str, dict]:
    out = {}
    for batch in read_source(spec):
        assert batch.schema == RECORD_SCHEMA
        for row in batch.to_pylist():
            assert row["source_key"] not in out
            row["metadata"] = dict(row["metadata"] or [])
            out[row["source_key"]] = row
    return out


# --- WebDataset ---------------------------------------------------------------------------------

def write_shards(folder: Path, photos: list[bytes]) -> None:
    """img2dataset-like samples (jpg + json{caption, url, ...} + cls) in two shards by ShardWriter,
    and a third shard by TarWriter with `txt` captions beside a JSON member."""
    folder.mkdir()
    with wds.ShardWriter(str(folder / "shard-%03d.tar"), maxcount=2) as sink:
        for i, photo in enumerate(photos[:4]):
            sink.write({"__key__": f"{i:05d}", "jpg": photo, "cls": i + 1,
                        "json": {"caption": f"photo {i}", "url": f"http://example.org/{i}.jpg", "key": f"{i:05d}",
                                 "width": 500, "similarity": 0.31, "license": "cc-by", "error_message": None}})
    with wds.TarWriter(str(folder / "shard-100.tar")) as sink:
        sink.write({"__key__": "t0", "jpg": photos[4], "txt": "a text caption", "json": {"caption": "json one"}})
        sink.write({"__key__": "t1", "jpg": photos[5], "txt": "only text"})


def test_webdataset_json_caption_cls_label_and_url(tmp_path: Path, photos: list[bytes]) -> None:
    write_shards(tmp_path / "wds", photos)
    default = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds")))
    explicit = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds"), caption_column="json.caption"))
    for got in (default, explicit):
        for i in range(4):
            row = got[f"{i:05d}"]
            assert row["image"] == photos[i] and row["caption"] == f"photo {i}" and row["reject_reason"] is None
            assert row["source_url"] == f"http://example.org/{i}.jpg"
            assert row["metadata"] == {"label": str(i + 1), "key": f"{i:05d}", "width": "500", "similarity": "0.31",
                                       "license": "cc-by"}
    assert default["t0"]["caption"] == "a text caption" and default["t1"]["caption"] == "only text"  # txt first
    assert default["t0"]["metadata"] == {"caption": "json one"}  # the losing caption is kept
    assert explicit["t0"]["caption"] == "json one"  # named: the JSON member's field
    assert explicit["t1"]["caption"] is None and explicit["t1"]["metadata"] == {"caption_error": "no .json member"}
    as_text = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds"), caption_column="txt"))
    assert as_text["t0"]["caption"] == "a text caption" and as_text["t0"]["metadata"] == {"caption": "json one"}
    assert as_text["00001"]["caption"] is None and as_text["00001"]["metadata"]["caption_error"] == "no .txt member"


def test_webdataset_bad_json_is_a_visible_note_not_a_reject(tmp_path: Path, photos: list[bytes],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "wds").mkdir()
    with wds.TarWriter(str(tmp_path / "wds" / "s.tar")) as sink:
        sink.write({"__key__": "broken", "jpg": photos[0], "json": b'{"caption": "cut off'})
        sink.write({"__key__": "list", "jpg": photos[1], "json": b'["not", "an", "object"]'})
        sink.write({"__key__": "other", "jpg": photos[2], "json": {"title": "no caption field"}})
        sink.write({"__key__": "deep", "jpg": photos[3], "json": {"meta": {"caption": "nested"}}})
        sink.write({"__key__": "fine", "jpg": photos[4], "json": {"text": "by the text field"}})
        sink.write({"__key__": "surrogate", "jpg": photos[5], "json": b'{"caption": "a\\ud800b", "x\\udc00": "\\udfff"}'})
    with caplog.at_level(logging.WARNING, logger="prx_core.sources.tars"):
        got = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds")))
    assert all(r["reject_reason"] is None and r["image"] for r in got.values())
    assert got["broken"]["caption"] is None and "not valid JSON" in got["broken"]["metadata"]["caption_error"]
    assert "not a JSON object" in got["list"]["metadata"]["caption_error"]
    assert got["other"]["caption"] is None
    assert got["other"]["metadata"] == {"title": "no caption field"}  # no caption named: no note
    assert got["fine"]["caption"] == "by the text field" and got["fine"]["metadata"] == {}
    assert got["surrogate"]["caption"] == "a\ufffdb" and got["surrogate"]["metadata"] == {"x\ufffd": "\ufffd"}
    assert "2 samples with a caption_error" in caplog.text and "broken" in caplog.text
    deep = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds"), caption_column="json.meta.caption"))
    assert deep["deep"]["caption"] == "nested"
    assert deep["other"]["metadata"]["caption_error"] == ".json member has no field 'meta.caption'"


def test_webdataset_reads_only_the_members_it_needs_within_limits(tmp_path: Path, photos: list[bytes],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "wds").mkdir()
    big = {"caption": "x" * 5000}
    with wds.TarWriter(str(tmp_path / "wds" / "s.tar")) as sink:
        sink.write({"__key__": "a", "jpg": photos[0], "txt": "text", "json": {"caption": "json"}, "npy": b"\0" * 999})
        sink.write({"__key__": "b", "jpg": photos[1], "txt": "small text", "json": big})
        sink.write({"__key__": "c", "jpg": photos[2], "cls": "9" * 300})
    read: list[str] = []
    extract = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: read.append(m.name) or extract(self, m))
    got = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds"), caption_column="json.caption",
                          max_caption_bytes=1000))
    assert "a.txt" not in read and "a.npy" not in read and "b.json" not in read and "c.cls" not in read
    assert got["a"]["caption"] == "json"
    assert got["b"]["reject_reason"] == "caption_too_large"  # the named caption member is over the limit
    assert "c.cls" in got["c"]["metadata"]["caption_error"] and "label" not in got["c"]["metadata"]
    read.clear()
    default = rows(SourceSpec("w", "webdataset", str(tmp_path / "wds"), max_caption_bytes=1000))
    assert default["b"]["caption"] == "small text" and default["b"]["reject_reason"] is None  # json: metadata only
    assert "over the limit 1000: not read" in default["b"]["metadata"]["caption_error"]
    assert set(read) == {"a.jpg", "a.txt", "a.json", "b.jpg", "b.txt", "c.jpg"}


@pytest.mark.parametrize("column", ["json", "meta.json", "json..caption", ".txt"])
def test_catalog_refuses_a_json_member_without_a_field(tmp_path: Path, column: str) -> None:
    document = {"sources": [{"name": "w", "format": "webdataset", "uri": "shards", "caption_column": column}]}
    with pytest.raises(CatalogError, match="source 'w': field 'caption_column'.*json.caption"):
        parse_catalog(document, tmp_path)
    ok = {"sources": [{"name": "w", "format": "webdataset", "uri": "s", "caption_column": "meta.json.caption"}]}
    assert parse_catalog(ok, tmp_path).sources[0].caption_column == "meta.json.caption"


# --- image folders ------------------------------------------------------------------------------

def save(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def hf_load(data_dir: Path, cache: Path) -> list[dict]:
    """What Hugging Face's own `imagefolder` builder yields for a tree (offline, images undecoded)."""
    import datasets

    dataset = datasets.load_dataset("imagefolder", data_dir=str(data_dir), split="train", cache_dir=str(cache))
    dataset = dataset.cast_column("image", datasets.Image(decode=False))
    label = dataset.features.get("label")
    label = label if isinstance(label, datasets.ClassLabel) else None
    out = []
    for row in dataset:
        row["file"] = os.path.relpath(row.pop("image")["path"], data_dir)
        if label is not None:
            row["label"] = label.int2str(row["label"])
        out.append(row)
    return out


def key_of(file: str) -> str:
    return file.rsplit(".", 1)[0]


def test_imagefolder_metadata_jsonl_as_huggingface_reads_it(tmp_path: Path, photos: list[bytes]) -> None:
    train = tmp_path / "train"
    files = ["a.jpg", "b.jpg", "more/c.jpg", "more/deeper/d.jpg"]
    for file, photo in zip(files, photos):
        save(train / file, photo)
    with open(train / "metadata.jsonl", "w") as out:
        for i, file in enumerate(files):
            out.write(json.dumps({"file_name": file, "text": f"caption of {file}", "license": f"cc-{i}"}) + "\n")
    hf = hf_load(train, tmp_path / "hf_cache")
    got = rows(SourceSpec("f", "imagefolder", str(train)))
    assert sorted(got) == sorted(key_of(r["file"]) for r in hf) == [key_of(f) for f in files]  # metadata: no sample
    for row in hf:
        ours = got[key_of(row["file"])]
        assert ours["caption"] == row["text"] and ours["metadata"] == {"license": row["license"]}
        assert ours["image"] == (train / row["file"]).read_bytes() and "label" not in ours["metadata"]


def test_imagefolder_class_folders_are_labels_as_in_huggingface(tmp_path: Path, photos: list[bytes]) -> None:
    train = tmp_path / "train"
    for i, photo in enumerate(photos):
        save(train / ("cat" if i % 2 else "dog") / f"img{i}.jpg", photo)
    save(train / "dog" / "img0.txt", b"a sidecar caption")
    hf = hf_load(train, tmp_path / "hf_cache")
    got = rows(SourceSpec("f", "imagefolder", str(train)))
    assert {key_of(r["file"]): r["label"] for r in hf} == {k: r["metadata"]["label"] for k, r in got.items()}
    assert got["dog/img0"]["caption"] == "a sidecar caption" and got["cat/img1"]["caption"] is None
    assert all(set(r["metadata"]) == {"label"} for r in got.values())


def test_imagefolder_metadata_csv_with_quoted_newlines(tmp_path: Path, photos: list[bytes]) -> None:
    """A root metadata.csv (written by the csv module, captions with commas and newlines) covers
    class folders; per HF, a metadata file means no folder labels, its `label` column is the label."""
    train = tmp_path / "train"
    files = ["x/a.jpg", "y/b.jpg", "x/c.jpg", "y/d.jpg"]
    for file, photo in zip(files, photos):
        save(train / file, photo)
    with open(train / "metadata.csv", "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["file_name", "caption", "label"])
        for i, file in enumerate(files):
            writer.writerow([file, f"line one of {i},\nline two \"quoted\"", f"class{i % 2}"])
    hf = hf_load(train, tmp_path / "hf_cache")
    got = rows(SourceSpec("f", "imagefolder", str(train), caption_column="caption"))
    assert len(got) == len(hf) == 4
    for row in hf:
        ours = got[key_of(row["file"])]
        assert ours["caption"] == row["caption"].strip() and ours["metadata"] == {"label": row["label"]}


def test_sidecar_wins_over_the_metadata_row_which_is_kept(tmp_path: Path, photos: list[bytes]) -> None:
    root = tmp_path / "ds"
    for name, photo in zip(["a", "b", "c", "d"], photos):
        save(root / f"{name}.jpg", photo)
    save(root / "a.txt", b"sidecar of a")
    save(root / "c.caption", b"")  # empty: the row's caption shows through
    rows_ = [{"file_name": "a.jpg", "text": "row of a", "n": 1}, {"file_name": "b.jpg", "text": "row of b"},
             {"file_name": "c.jpg", "text": "row of c"}, {"file_name": "../d.jpg", "text": "escapes"},
             {"file_name": "/etc/passwd", "text": "absolute"}]
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows_)) + "\n{not json\n")
    got = rows(SourceSpec("f", "imagefolder", str(root)))
    assert set(got) == {"a", "b", "c", "d"}
    assert got["a"]["caption"] == "sidecar of a" and got["a"]["metadata"] == {"text": "row of a", "n": "1"}
    assert got["b"]["caption"] == "row of b" and got["b"]["metadata"] == {}
    assert got["c"]["caption"] == "row of c"
    note = got["d"]["metadata"]["caption_error"]  # `../d.jpg` names nothing inside the root
    assert got["d"]["caption"] is None and "no row for d.jpg in metadata.jsonl" in note and "3 of its rows" in note


def test_a_refused_metadata_file_is_a_note_never_a_sample(tmp_path: Path, photos: list[bytes],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"file_name": "a.jpg", "text": "stolen"}) + "\n")
    linked, large = tmp_path / "linked", tmp_path / "large"
    save(linked / "sub" / "a.jpg", photos[0])
    (linked / "metadata.jsonl").symlink_to(secret)
    save(large / "a.jpg", photos[1])
    (large / "metadata.csv").write_text("file_name,text\na.jpg," + "x" * 500 + "\n")
    save(linked / "own" / "b.jpg", photos[2])
    (linked / "own" / "metadata.csv").symlink_to(secret)
    got = rows(SourceSpec("f", "imagefolder", str(linked)))
    assert sorted(got) == ["own/b", "sub/a"]  # the metadata files: neither samples nor rejects
    assert got["sub/a"]["caption"] is None and got["sub/a"]["reject_reason"] is None
    assert got["sub/a"]["metadata"] == {"caption_error": "metadata.jsonl: a symbolic link: not followed"}
    assert got["own/b"]["metadata"] == {"caption_error": "own/metadata.csv: a symbolic link: not followed; "
                                                         "metadata.jsonl: a symbolic link: not followed"}
    save(large / "sub" / "b.jpg", photos[3])
    (large / "sub" / "metadata.parquet").write_bytes(b"PAR1")  # HF reads these: here a note says it is not
    monkeypatch.setattr(folder_metadata, "MAX_METADATA_BYTES", 100)
    got = rows(SourceSpec("f", "imagefolder", str(large)))
    assert got["a"]["caption"] is None and "over the limit of 100" in got["a"]["metadata"]["caption_error"]
    assert got["sub/b"]["metadata"]["caption_error"].startswith("sub/metadata.parquet: not read: write the metadata "
                                                                "as metadata.jsonl or metadata.csv; metadata.csv: ")


def test_overlong_lines_are_skipped_and_counted(tmp_path: Path, photos: list[bytes],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(folder_metadata, "MAX_LINE_BYTES", 200)
    jsonl, table = tmp_path / "jsonl", tmp_path / "csv"
    for folder in (jsonl, table):
        for name, photo in zip("abc", photos):
            save(folder / f"{name}.jpg", photo)
    texts = {"a": "short a", "b": "long " * 100, "c": "short c"}
    (jsonl / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{k}.jpg", "text": v}) + "\n"
                                                  for k, v in texts.items()))
    (table / "metadata.csv").write_text("file_name,text\n" + "".join(f"{k}.jpg,{v}\n" for k, v in texts.items()))
    got = rows(SourceSpec("f", "imagefolder", str(jsonl)))
    assert (got["a"]["caption"], got["c"]["caption"], got["b"]["caption"]) == ("short a", "short c", None)
    assert "1 of its rows unreadable, first metadata.jsonl line at byte 42: longer than 200 bytes" in \
        got["b"]["metadata"]["caption_error"]
    got = rows(SourceSpec("f", "imagefolder", str(table)))  # a CSV line cannot be skipped alone: the file is not read
    assert all(r["caption"] is None and "longer than 200 bytes" in r["metadata"]["caption_error"] for r in got.values())


def test_a_root_metadata_file_is_indexed_once_per_worker(tmp_path: Path, photos: list[bytes],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Many class folders under one root metadata.jsonl: streamed once, then each folder reads its
    own rows; interleaved past the cache's budget it is streamed per folder, same rows."""
    root = tmp_path / "ds"
    lines = []
    for i in range(30):
        folder = f"f{i % 3}"
        if i < 6:
            save(root / folder / f"{i}.jpg", photos[i])
        lines.append(json.dumps({"file_name": f"{folder}/{i}.jpg", "text": f"caption {i}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    builds, opened = [], []
    build, open_ = folder_metadata._build, folder_metadata._open
    monkeypatch.setattr(folder_metadata, "_build", lambda *a: builds.append(1) or build(*a))
    monkeypatch.setattr(folder_metadata, "_open", lambda *a: opened.append(1) or open_(*a))
    folder_metadata._CACHE.clear()
    got = rows(SourceSpec("f", "imagefolder", str(root)))
    assert {k: r["caption"] for k, r in got.items()} == {f"f{i % 3}/{i}": f"caption {i}" for i in range(6)}
    assert len(builds) == 1 and len(opened) == 3  # parsed once, then one ranged read per folder
    index = next(iter(folder_metadata._CACHE.values()))
    assert index.count == 30 and sorted(index.spans) == ["f0", "f1", "f2"]  # interleaved: one span a row
    monkeypatch.setattr(folder_metadata, "CACHE_SPANS", 10)
    folder_metadata._CACHE.clear()
    builds.clear()
    assert rows(SourceSpec("f", "imagefolder", str(root))) == got
    assert len(builds) == 3 and not folder_metadata._CACHE  # too big to keep: streamed again per folder


def test_imagefolder_metadata_on_s3(s3_endpoint: dict, tmp_path: Path, photos: list[bytes]) -> None:
    """The same tree read from s3:// (ancestor metadata found by one HEAD each, read by ranges)
    gives the same rows as from the local copy."""
    import boto3
    import s3fs

    root = tmp_path / "ds"
    for i, photo in enumerate(photos[:4]):
        save(root / f"c{i % 2}" / f"{i}.jpg", photo)
    (root / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"c{i % 2}/{i}.jpg", "text": f"t{i}",
                                                             "size": i}) + "\n" for i in range(4)))
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="captions")
    s3fs.S3FileSystem(**s3_endpoint["storage_options"]).put(str(root), "captions/ds", recursive=True)
    folder_metadata._CACHE.clear()
    remote = {}
    for batch in read_source(SourceSpec("f", "imagefolder", "s3://captions/ds"), s3_endpoint["storage_options"]):
        remote.update({r["source_key"]: (r["image"], r["caption"], dict(r["metadata"] or [])) for r in batch.to_pylist()})
    local = {k: (r["image"], r["caption"], r["metadata"])
             for k, r in rows(SourceSpec("f", "imagefolder", str(root))).items()}
    assert remote == local and local["c1/3"][1:] == ("t3", {"size": "3"})


# --- through the samples stage ------------------------------------------------------------------

def test_samples_stage_keeps_captions_labels_and_metadata(ray_cluster, tmp_path: Path, photos: list[bytes]) -> None:
    root = tmp_path / "folder"
    captioned = ["captioned/a.jpg", "captioned/more/b.jpg"]
    for file, photo in zip(captioned, photos):
        save(root / file, photo)
    (root / "captioned" / "metadata.jsonl").write_text("\n".join(
        json.dumps({"file_name": f[len("captioned/"):], "text": f"a photo {f}", "license": "cc0"}) for f in captioned))
    for i, photo in enumerate(photos[2:]):
        save(root / "classes" / ("cat" if i % 2 else "dog") / f"{i}.jpg", photo)
    write_shards(tmp_path / "wds", photos)
    storage = Storage(str(tmp_path / "corpus"))
    folder = build_samples(SourceSpec("folder", "imagefolder", str(root)), storage, unit_bytes=1)
    shards = build_samples(SourceSpec("shards", "webdataset", str(tmp_path / "wds"), caption_column="json.caption"),
                           storage, unit_bytes=1)
    assert (folder.rows, folder.rejected, shards.rows, shards.rejected) == (6, 0, 6, 0)
    columns = ["source", "source_key", "original_caption", "metadata", "source_url"]
    table = lance.dataset(storage.lance_uri("samples")).to_table(columns=columns)
    got = {(r["source"], r["source_key"]): r for r in table.to_pylist()}
    assert {k for s, k in got if s == "folder"} == {"captioned/a", "captioned/more/b", "classes/dog/0",
                                                   "classes/cat/1", "classes/dog/2", "classes/cat/3"}
    assert got["folder", "captioned/more/b"]["original_caption"] == "a photo captioned/more/b.jpg"
    assert dict(got["folder", "captioned/more/b"]["metadata"]) == {"license": "cc0"}
    assert dict(got["folder", "classes/cat/3"]["metadata"]) == {"label": "cat"}
    assert got["folder", "classes/cat/3"]["original_caption"] is None
    assert got["shards", "00002"]["original_caption"] == "photo 2"
    assert dict(got["shards", "00002"]["metadata"])["label"] == "3"
    assert got["shards", "00002"]["source_url"] == "http://example.org/2.jpg"
    assert got["shards", "t1"]["original_caption"] is None
    for source in ("folder", "shards"):
        rejects = lance.dataset(storage.lance_uri("rejects")).to_table(filter=rejects_predicate(source, "samples"))
        assert rejects.num_rows == 0
        assert lance.dataset(storage.lance_uri("samples")).count_rows(source_predicate(source)) == 6
