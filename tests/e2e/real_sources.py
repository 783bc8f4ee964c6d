"""Sources as users hold them, each written by the tool that writes it in the wild.

`datasets` (parquet with an `Image()` column, the Hub's layout, `save_to_disk`), the Hugging Face
`imagefolder` convention, `webdataset`'s TarWriter, `lancedb`, `img2dataset` run against a loopback
HTTP server, and a LAION-style table of URLs. Every writer returns the catalog entry a user would
write for it and the captions it planted, so a test can follow each sample to MDS.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from prx_core.demo.photos import load_skimage_photos

SIZES = ((512, 512), (640, 480), (480, 640), (600, 450), (448, 576))  # above the 384x384 floor, ratios in [0.5, 2]


@dataclass(frozen=True)
class Photo:
    name: str
    jpeg: bytes
    caption: str


@dataclass
class Written:
    """One source as written: its catalog entry and caption -> planted count."""

    entry: dict[str, Any]
    captions: list[str] = field(default_factory=list)


def photos(count: int = 5, offset: int = 0) -> list[Photo]:
    """`count` real colour photos (scikit-image's samples) as JPEGs of distinct sizes."""
    colour = [p for p in load_skimage_photos() if p.image.mode == "RGB"]
    out = []
    for i in range(count):
        base = colour[(i + offset) % len(colour)]
        width, height = SIZES[(i + offset) % len(SIZES)]
        image = base.image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append(Photo(f"{base.name.split('.')[0]}_{i + offset}", buffer.getvalue(), f"{base.caption} ({i + offset})"))
    return out


def hf_dataset(batch: list[Photo]) -> Any:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": p.jpeg, "path": f"{p.name}.jpg"} for p in batch], "text": [p.caption for p in batch]},
        features=features)


def write_hf_parquet(root: Path, batch: list[Photo]) -> Written:
    """`Dataset.to_parquet`: an Image() struct column read with format parquet."""
    hf_dataset(batch).to_parquet(str(root / "hf_parquet" / "train.parquet"))
    return Written({"name": "hf_parquet", "format": "parquet", "uri": "hf_parquet", "image_column": "image",
                    "caption_column": "text"}, [p.caption for p in batch])


def write_hf_hub(root: Path, batch: list[Photo]) -> Written:
    """The Hub's layout (`data/train-0000K-of-0000N.parquet` and a card), no columns named."""
    ds = hf_dataset(batch)
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(root / "hf_hub" / "data" / f"train-{k:05d}-of-00002.parquet"))
    (root / "hf_hub" / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: data/*\n---\n")
    return Written({"name": "hf_hub", "format": "huggingface", "uri": "hf_hub"}, [p.caption for p in batch])


def write_hf_disk(root: Path, batch: list[Photo]) -> Written:
    """`Dataset.save_to_disk`: Arrow IPC files and dataset_info.json."""
    hf_dataset(batch).save_to_disk(str(root / "hf_disk"))
    return Written({"name": "hf_disk", "format": "huggingface", "uri": "hf_disk"}, [p.caption for p in batch])


def write_imagefolder(root: Path, batch: list[Photo]) -> Written:
    """The HF `imagefolder` convention: sub-folders and a metadata.jsonl of file_name, text and license
    (with a metadata file, as in Hugging Face, folder names are not labels)."""
    folder = root / "folder" / "train"
    lines = []
    for i, p in enumerate(batch):
        label = ("cat", "dog")[i % 2]
        (folder / label).mkdir(parents=True, exist_ok=True)
        (folder / label / f"{p.name}.jpg").write_bytes(p.jpeg)
        lines.append(json.dumps({"file_name": f"{label}/{p.name}.jpg", "text": p.caption, "license": "cc0-1.0"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return Written({"name": "folder", "format": "imagefolder", "uri": "folder"}, [p.caption for p in batch])


def write_webdataset(root: Path, batch: list[Photo]) -> Written:
    """webdataset's TarWriter: the caption inside a `.json` member, a `.cls` label."""
    import webdataset

    (root / "wds").mkdir(parents=True, exist_ok=True)
    with webdataset.TarWriter(str(root / "wds" / "shard-000000.tar")) as sink:
        for i, p in enumerate(batch):
            sink.write({"__key__": f"{i:06d}", "jpg": p.jpeg, "json": {"caption": p.caption, "width": 0}, "cls": i % 3})
    return Written({"name": "wds", "format": "webdataset", "uri": "wds", "caption_column": "json.caption"},
                   [p.caption for p in batch])


def write_lancedb(root: Path, batch: list[Photo]) -> Written:
    """A lancedb table of image bytes and captions, read as format lance."""
    import lancedb
    import pyarrow as pa

    table = pa.table({"id": [p.name for p in batch], "image": pa.array([p.jpeg for p in batch], pa.binary()),
                      "caption": [p.caption for p in batch]})
    lancedb.connect(str(root / "lancedb")).create_table("photos", table)
    return Written({"name": "lancedb_photos", "format": "lance", "uri": "lancedb/photos.lance", "image_column": "image",
                    "caption_column": "caption", "key_column": "id"}, [p.caption for p in batch])


def write_joined(root: Path, batch: list[Photo]) -> Written:
    """Images, captions and CLIP vectors in three tables keyed by id (the vectors in lancedb)."""
    import lancedb
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "joined" / "images").mkdir(parents=True)
    (root / "joined" / "captions").mkdir()
    pq.write_table(pa.table({"id": [p.name for p in batch], "image": pa.array([p.jpeg for p in batch], pa.binary()),
                             "license": ["cc-by-4.0"] * len(batch)}), root / "joined" / "images" / "part-0.parquet")
    pq.write_table(pa.table({"id": [p.name for p in batch], "caption": [p.caption for p in batch]}),
                   root / "joined" / "captions" / "part-0.parquet")
    vectors = [[float(i + 1)] * 8 for i in range(len(batch))]
    lancedb.connect(str(root / "joined" / "clip")).create_table(
        "clip", pa.table({"id": [p.name for p in batch], "clip": pa.array(vectors, pa.list_(pa.float32(), 8))}))
    return Written({"name": "joined", "format": "parquet", "uri": "joined/images", "image_column": "image",
                    "key_column": "id", "metadata_columns": ["license"],
                    "joins": [{"uri": "joined/captions", "key_column": "id", "caption_column": "caption"},
                              {"uri": "joined/clip/clip.lance", "key_column": "id", "embedding_column": "clip"}]},
                   [p.caption for p in batch])


Publish = Callable[[str, bytes], str]  # (name, bytes) -> the loopback URL that serves them
Missing = Callable[[str], str]  # name -> a loopback URL that answers 404


def write_url_table(root: Path, batch: list[Photo], publish: Publish, missing: Missing) -> Written:
    """A LAION-style metadata-only table: URL, TEXT, WIDTH, HEIGHT, similarity; the images are
    served on loopback (`publish`), one URL is gone (`missing`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for p in batch:
        with Image.open(io.BytesIO(p.jpeg)) as im:
            width, height = im.size
        rows.append({"URL": publish(f"laion_{p.name}", p.jpeg), "TEXT": p.caption, "WIDTH": width, "HEIGHT": height,
                     "similarity": 0.31})
    rows.append({"URL": missing("laion_gone"), "TEXT": "gone", "WIDTH": 500, "HEIGHT": 500, "similarity": 0.3})
    (root / "laion").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "laion" / "part-00000.parquet")
    return Written({"name": "laion", "format": "parquet", "uri": "laion", "url_column": "URL", "caption_column": "TEXT",
                    "download": {"allow_networks": ["127.0.0.1/32"]}},  # the loopback server: opted in
                   [p.caption for p in batch])


def write_img2dataset(root: Path, batch: list[Photo], publish: Publish, missing: Missing,
                      output_format: str) -> Written:
    """img2dataset itself, fetching from loopback (`resize_mode="no"`: its default 256x256 falls
    under the 384x384 floor), one URL failing."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from img2dataset import download

    rows = [{"url": publish(f"i2d_{p.name}", p.jpeg), "caption": p.caption} for p in batch]
    rows.append({"url": missing("i2d_gone"), "caption": "gone"})
    listing = root / f"i2d_{output_format}_urls.parquet"
    pq.write_table(pa.Table.from_pylist(rows), listing)
    name = f"i2d_{output_format}"
    download(url_list=str(listing), input_format="parquet", url_col="url", caption_col="caption",
             output_folder=str(root / name), output_format=output_format, resize_mode="no", processes_count=1,
             thread_count=2, distributor="multiprocessing", enable_wandb=False, save_additional_columns=[],
             timeout=5, retries=0)
    entry: dict[str, Any] = {"name": name, "format": output_format, "uri": name}
    if output_format == "parquet":
        entry.update(image_column="jpg", caption_column="caption", key_column="key")
    return Written(entry, [p.caption for p in batch])
