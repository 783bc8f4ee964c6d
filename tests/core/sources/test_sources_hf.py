"""Hugging Face datasets as `datasets` writes them (real photos, the real library): an `Image()`
column in parquet read as its bytes or from its path, `format: huggingface` over `save_to_disk`
folders and the Hub's parquet layout with columns taken from the features, the refusals of
untrusted paths, and the error of a folder given in the wrong format; read through the readers,
from loopback S3, and through the real `samples` stage on a local Ray."""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.sources.catalog import CatalogError, DownloadSettings, SourceSpec
from prx_core.sources.readers import BATCH_ROWS, RECORD_SCHEMA, fragment_sizes, read_fragment, read_source

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
PHOTOS = {"astronaut.png": "an astronaut in an orange suit", "coffee.png": "a cup of coffee with latte art",
          "chelsea.png": "a tabby cat looking to the side", "rocket.jpg": "a rocket on its launch pad"}
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
HF_META = {"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"},
                                                            "text": {"dtype": "string", "_type": "Value"}}}})}


@pytest.fixture(scope="module")
def photos() -> list[tuple[bytes, str]]:
    """Real photos (scikit-image's samples) as JPEGs of at most 512 px, with captions."""
    import skimage
    from PIL import Image

    out = []
    for name, caption in PHOTOS.items():
        with Image.open(Path(skimage.__file__).parent / "data" / name) as image:
            image = image.convert("RGB")
            image.thumbnail((512, 512))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=90)
        out.append((buffer.getvalue(), caption))
    return out


def hf_dataset(photos: list[tuple[bytes, str]], caption: str = "text", extra: dict | None = None):
    import datasets

    datasets.disable_progress_bars()
    features = {"image": datasets.Image(), caption: datasets.Value("string"),
                **{k: datasets.Value("string") for k in extra or {}}}
    return datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b, _ in photos],
                                       caption: [c for _, c in photos], **(extra or {})},
                                      features=datasets.Features(features))


def rows(spec: SourceSpec, storage_options: dict | None = None) -> dict[str, dict]:
    out = {}
    for batch in read_source(spec, storage_options):
        assert batch.schema == RECORD_SCHEMA and batch.num_rows <= BATCH_ROWS
        for row in batch.to_pylist():
            assert row["source_key"] not in out
            out[row["source_key"]] = row
    return out


def test_to_parquet_image_column_is_read_as_its_bytes(photos, tmp_path: Path) -> None:
    hf_dataset(photos).to_parquet(str(tmp_path / "train.parquet"))
    assert pq.read_schema(tmp_path / "train.parquet").field("image").type == IMAGE_STRUCT  # datasets' own layout
    got = rows(SourceSpec("hf", "parquet", str(tmp_path), image_column="image", caption_column="text"))
    assert {k: (r["image"], r["caption"]) for k, r in got.items()} == {f"train:{i}": p for i, p in enumerate(photos)}
    assert all(r["reject_reason"] is None for r in got.values())


def test_hub_layout_defaults_its_columns_from_the_features(photos, tmp_path: Path) -> None:
    tmp_path = tmp_path / ".prx" / "hub"  # a hidden folder above the dataset (make demo's .prx/) is no cache
    ds = hf_dataset(photos, extra={"license": ["cc-by-4.0"] * len(photos)})
    (tmp_path / "data").mkdir(parents=True)
    for shard in range(2):
        ds.shard(num_shards=2, index=shard, contiguous=True).to_parquet(
            str(tmp_path / "data" / f"train-{shard:05d}-of-00002.parquet"))
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: data/train-*\n---\n")
    spec = SourceSpec("hub", "huggingface", str(tmp_path))  # no column named: image and text from the features
    assert [Path(f).name for f, _ in fragment_sizes(spec)] == ["train-00000-of-00002.parquet",
                                                                "train-00001-of-00002.parquet"]
    got = rows(spec)
    want = {"data/train-00000-of-00002:0": photos[0], "data/train-00000-of-00002:1": photos[1],
            "data/train-00001-of-00002:0": photos[2], "data/train-00001-of-00002:1": photos[3]}
    assert {k: (r["image"], r["caption"]) for k, r in got.items()} == want  # `text`, not `license`


def test_save_to_disk_dataset_and_dataset_dict(photos, tmp_path: Path) -> None:
    import datasets

    one = tmp_path / "one"
    hf_dataset(photos, caption="caption").save_to_disk(str(one))
    datasets.load_from_disk(str(one)).map(lambda row: row)  # leaves a cache-*.arrow beside the data
    assert list(one.glob("cache-*.arrow")) and list(one.glob("data-*.arrow"))
    spec = SourceSpec("disk", "huggingface", str(one))
    assert [Path(f).name for f, _ in fragment_sizes(spec)] == ["data-00000-of-00001.arrow"]
    got = rows(spec)
    assert [(k, r["image"], r["caption"]) for k, r in got.items()] == [
        (f"data-00000-of-00001:{i}", *p) for i, p in enumerate(photos)]  # `caption` when there is no `text`

    many = [photos[i % len(photos)] for i in range(BATCH_ROWS + 44)]  # more rows than a batch of ours
    splits = datasets.DatasetDict({"train": hf_dataset(many, caption="alt"), "test": hf_dataset(photos[:1], "alt")})
    splits.save_to_disk(str(tmp_path / "dict"))
    spec = SourceSpec("dict", "huggingface", str(tmp_path / "dict"))
    fragments = [f for f, _ in fragment_sizes(spec)]
    assert [Path(f).parent.name for f in fragments] == ["test", "train"]
    batches = list(read_fragment(spec, fragments[1]))
    assert sum(b.num_rows for b in batches) == len(many) and max(b.num_rows for b in batches) <= BATCH_ROWS
    got = rows(spec)
    assert len(got) == len(many) + 1 and got["test/data-00000-of-00001:0"]["caption"] == photos[0][1]
    assert got["train/data-00000-of-00001:0"]["image"] == photos[0][0]  # both splits read; keys never collide
    assert got[f"train/data-00000-of-00001:{BATCH_ROWS + 1}"]["caption"] == many[BATCH_ROWS + 1][1]  # the only string


def test_arrow_ipc_file_format_and_big_batches_are_resliced(photos, tmp_path: Path) -> None:
    """One 600-row batch (datasets writes 100-row batches of images; other writers do not) in the
    IPC file format, not the stream format: read in batches of at most BATCH_ROWS rows."""
    many = [photos[i % len(photos)] for i in range(600)]
    table = pa.table({"image": pa.array([{"bytes": b, "path": None} for b, _ in many], IMAGE_STRUCT),
                      "text": [c for _, c in many]}).replace_schema_metadata(HF_META)
    with pa.OSFile(str(tmp_path / "big.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_batch(table.combine_chunks().to_batches()[0])
    batches = list(read_fragment(SourceSpec("big", "huggingface", str(tmp_path)), str(tmp_path / "big.arrow")))
    assert [b.num_rows for b in batches] == [BATCH_ROWS, BATCH_ROWS, 600 - 2 * BATCH_ROWS]
    got = [r for b in batches for r in b.to_pylist()]
    assert [(r["source_key"], r["image"], r["caption"]) for r in got] == [
        (f"big:{i}", b, c) for i, (b, c) in enumerate(many)]


def test_an_unknown_image_column_names_the_source_file_and_fix(photos, tmp_path: Path) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"jpg": [b for b, _ in photos], "text": [c for _, c in photos]})
    table.save_to_disk(str(tmp_path))
    spec = SourceSpec("raw", "huggingface", str(tmp_path))
    with pytest.raises(ValueError, match=r"^source 'raw': cannot tell the image column of 'data-00000-of-00001.arrow'"
                                         r" .*: name it in the catalog, image_column: <column> \(columns: jpg, text\)"):
        list(read_source(spec))
    got = rows(SourceSpec("raw", "huggingface", str(tmp_path), image_column="jpg"))
    assert [(r["image"], r["caption"]) for r in got.values()] == photos


def test_imagefolder_exported_to_parquet_keeps_paths(photos, tmp_path: Path) -> None:
    """`load_dataset("imagefolder")` then `to_parquet` embeds no bytes: the struct holds the
    original files' absolute paths, read when they lie under the source root, refused otherwise."""
    import datasets

    folder = tmp_path / "folder"
    (folder / "train").mkdir(parents=True)
    with open(folder / "train" / "metadata.jsonl", "w") as meta:
        for i, (data, caption) in enumerate(photos):
            (folder / "train" / f"{i}.jpg").write_bytes(data)
            meta.write(json.dumps({"file_name": f"{i}.jpg", "text": caption}) + "\n")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    loaded.to_parquet(str(folder / "export.parquet"))
    (tmp_path / "elsewhere").mkdir()
    loaded.to_parquet(str(tmp_path / "elsewhere" / "export.parquet"))
    structs = pq.read_table(folder / "export.parquet").column("image").to_pylist()
    assert all(s["bytes"] is None and Path(s["path"]).parent == folder / "train" for s in structs)

    inside = rows(SourceSpec("inside", "parquet", str(folder), image_column="image", caption_column="text"))
    assert sorted((r["image"], r["caption"]) for r in inside.values()) == sorted(photos)
    outside = rows(SourceSpec("outside", "parquet", str(tmp_path / "elsewhere"), image_column="image"))
    assert {r["reject_reason"] for r in outside.values()} == {"path_outside_source"}
    assert all(not r["image"] for r in outside.values())
    message = next(iter(outside.values()))["reject_message"]
    assert str(folder / "train") in message and "outside the source root" in message and "embed" in message


def path_table(root: Path, photos: list[tuple[bytes, str]]) -> Path:
    """A parquet of Image() structs (built with pyarrow) under `root/sub`, one row per case."""
    (root / "sub" / "img").mkdir(parents=True)
    (root / "other").mkdir()
    (root / "sub" / "img" / "a.jpg").write_bytes(photos[1][0])
    (root / "other" / "b.jpg").write_bytes(photos[2][0])
    (root.parent / "secret.jpg").write_bytes(photos[3][0])
    (root / "sub" / "img" / "link.jpg").symlink_to(root.parent / "secret.jpg")
    (root / "sub" / "img" / "big.jpg").write_bytes(photos[0][0] + b"\0" * 200_000)
    os.mkfifo(root / "sub" / "img" / "pipe.jpg")
    cases = [(photos[0][0], "astronaut.jpg"), (None, "img/a.jpg"), (None, "../other/b.jpg"), (None, "img/missing.jpg"),
             (None, str(root.parent / "secret.jpg")), (None, "../../secret.jpg"), (None, "img/link.jpg"),
             (None, "img/big.jpg"), (None, "img/pipe.jpg"), (None, None), (None, "hf://datasets/x/y.jpg")]
    table = pa.table({"image": pa.array([{"bytes": b, "path": p} for b, p in cases], IMAGE_STRUCT),
                      "text": [f"case {i}" for i in range(len(cases))]}).replace_schema_metadata(HF_META)
    pq.write_table(table, root / "sub" / "part.parquet")
    return root


PATH_CASES = {0: None, 1: None, 2: None, 3: "unreadable_file", 4: "path_outside_source", 5: "path_outside_source",
              6: "path_outside_source", 7: "image_too_large", 8: "not_regular_file", 9: "empty", 10: "unreadable_file"}


def test_image_paths_are_read_under_the_root_and_refused_outside(photos, tmp_path: Path) -> None:
    root = path_table(tmp_path / "src", photos)
    spec = SourceSpec("paths", "huggingface", str(root), max_image_bytes=len(photos[0][0]) + 1000)
    got = {int(k.rsplit(":", 1)[1]): r for k, r in rows(spec).items()}
    assert {i: r["reject_reason"] for i, r in got.items()} == PATH_CASES
    assert [got[i]["image"] for i in (0, 1, 2)] == [photos[0][0], photos[1][0], photos[2][0]]
    assert all(not r["image"] for r in got.values() if r["reject_reason"])
    assert "img/missing.jpg" in got[3]["reject_message"] and "No such file" in got[3]["reject_message"]
    assert "neither bytes nor a path" in got[9]["reject_message"]
    assert "scheme" in got[10]["reject_message"]


def test_url_paths_are_handed_to_the_downloader(photos, tmp_path: Path) -> None:
    """An Image() path that is a URL is fetched (here from a loopback server) like a url_column's."""
    import http.server
    import threading

    class Photo(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = photos[int(self.path.strip("/").split(".")[0])][0] if self.path != "/gone.jpg" else None
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Photo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = [f"{base}/1.jpg", f"{base}/gone.jpg"]
        table = pa.table({"image": pa.array([{"bytes": None, "path": u} for u in urls], IMAGE_STRUCT),
                          "text": ["fetched", "missing"]})
        pq.write_table(table, tmp_path / "urls.parquet")
        loopback = DownloadSettings(allow_networks=("127.0.0.1/32",))  # a source opts in to a non-public host
        got = rows(SourceSpec("urls", "parquet", str(tmp_path), image_column="image", caption_column="text",
                              download=loopback))
    finally:
        server.shutdown()
    assert got["urls:0"]["image"] == photos[1][0] and got["urls:0"]["source_url"] == urls[0]
    assert got["urls:1"]["reject_reason"] == "download_error" and "404" in got["urls:1"]["reject_message"]


def test_a_folder_in_the_wrong_format_says_what_it_holds(photos, tmp_path: Path) -> None:
    hf_dataset(photos).save_to_disk(str(tmp_path / "disk"))
    with pytest.raises(CatalogError, match=r"^source 'x': no \.parquet file under .*disk \(found 2 \.json files, "
                                           r"1 \.arrow file: a Dataset.save_to_disk folder; use format: huggingface\)"):
        fragment_sizes(SourceSpec("x", "parquet", str(tmp_path / "disk"), image_column="image"))
    with pytest.raises(CatalogError, match=r"no \.tar shard under .* use format: huggingface"):
        fragment_sizes(SourceSpec("x", "webdataset", str(tmp_path / "disk")))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.jpg").write_bytes(photos[0][0])
    with pytest.raises(CatalogError, match=r"no \.arrow or \.parquet file .*1 \.jpg file: image files; use format: "
                                           r"imagefolder"):
        fragment_sizes(SourceSpec("x", "huggingface", str(tmp_path / "pics")))
    (tmp_path / "empty").mkdir()  # nothing at all: the samples stage's empty-source guard speaks for it
    assert fragment_sizes(SourceSpec("x", "parquet", str(tmp_path / "empty"), image_column="image")) == []


def test_save_to_disk_and_paths_on_s3(photos, s3_endpoint: dict, tmp_path: Path) -> None:
    """The same records from loopback S3 as from the local copy; a relative path leaving the
    source's prefix is refused there too."""
    import boto3
    import s3fs

    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="hf-sources")
    options = s3_endpoint["storage_options"]
    fs = s3fs.S3FileSystem(**options)
    hf_dataset(photos).save_to_disk(str(tmp_path / "disk"))
    path_table(tmp_path / "paths", photos)
    (tmp_path / "paths" / "sub" / "img" / "pipe.jpg").unlink()  # no FIFO nor link on S3: plain objects
    (tmp_path / "paths" / "sub" / "img" / "link.jpg").unlink()
    for name in ("disk", "paths"):
        fs.put(str(tmp_path / name), f"hf-sources/{name}", recursive=True)
    fs.put(str(tmp_path / "secret.jpg"), "hf-sources/secret.jpg")
    disk = SourceSpec("disk", "huggingface", str(tmp_path / "disk"))
    assert rows(SourceSpec("disk", "huggingface", "s3://hf-sources/disk"), options) == rows(disk)
    spec = SourceSpec("paths", "huggingface", "s3://hf-sources/paths", max_image_bytes=len(photos[0][0]) + 1000)
    got = {int(k.rsplit(":", 1)[1]): r for k, r in rows(spec, options).items()}
    assert {i: r["reject_reason"] for i, r in got.items()} == {**PATH_CASES, 6: "unreadable_file", 8: "unreadable_file"}
    assert [got[i]["image"] for i in (0, 1, 2)] == [photos[0][0], photos[1][0], photos[2][0]]


@pytest.mark.usefixtures("ray_cluster")
def test_samples_stage_ingests_hf_sources(photos, tmp_path: Path) -> None:
    """Through the real `samples` stage: a DatasetDict saved to disk gives every split's rows with
    captions, and a table of paths gives its rows plus one reject per refused path."""
    import datasets

    from prx_core.stages.samples.stage import build_samples
    from prx_core.store.partitions import rejects_predicate, source_predicate
    from prx_core.store.storage import Storage

    datasets.DatasetDict({"train": hf_dataset(photos[:3]), "validation": hf_dataset(photos[3:])}).save_to_disk(
        str(tmp_path / "dict"))
    storage = Storage(str(tmp_path / "corpus"))
    report = build_samples(SourceSpec("hf_dict", "huggingface", str(tmp_path / "dict")), storage, unit_bytes=1)
    assert (report.rows, report.rejected, report.fragments_read) == (4, 0, 2)
    samples = lance.dataset(storage.lance_uri("samples")).to_table(filter=source_predicate("hf_dict")).to_pylist()
    assert sorted((s["source_key"], s["original_caption"]) for s in samples) == [
        ("train/data-00000-of-00001:0", photos[0][1]), ("train/data-00000-of-00001:1", photos[1][1]),
        ("train/data-00000-of-00001:2", photos[2][1]), ("validation/data-00000-of-00001:0", photos[3][1])]
    assert all(s["width"] <= 512 and s["height"] <= 512 and s["format"] == "JPEG" for s in samples)

    root = path_table(tmp_path / "paths", photos)
    spec = SourceSpec("hf_paths", "huggingface", str(root), max_image_bytes=len(photos[0][0]) + 1000)
    report = build_samples(spec, storage)
    assert (report.rows, report.reasons) == (3, dict(Counter(r for r in PATH_CASES.values() if r)))
    rejects = lance.dataset(storage.lance_uri("rejects")).to_table(
        filter=rejects_predicate("hf_paths", "samples")).to_pylist()
    by_key = {r["source_key"]: r for r in rejects}
    assert by_key["sub/part:4"]["reason"] == "path_outside_source" and "secret.jpg" in by_key["sub/part:4"]["message"]

    datasets.Dataset.from_dict({"jpg": [b for b, _ in photos]}).save_to_disk(str(tmp_path / "raw"))
    with pytest.raises(RuntimeError, match=r"source 'hf_raw'.*image_column: <column>"):  # the run says why, at the top
        build_samples(SourceSpec("hf_raw", "huggingface", str(tmp_path / "raw")), storage)
    rejects = lance.dataset(storage.lance_uri("rejects")).to_table(
        filter=rejects_predicate("hf_raw", "samples")).to_pylist()
    assert [(r["source_key"], r["reason"]) for r in rejects] == [(str(tmp_path / "raw" / "data-00000-of-00001.arrow"),
                                                                  "unreadable_fragment")]
    assert "cannot tell the image column" in rejects[0]["message"]
