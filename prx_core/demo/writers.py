"""Writers for the demo source formats: parquet, image folder, WebDataset tar shards, and a Hugging
Face dataset in the Hub's own parquet layout."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

EMBEDDING_DIM = 512
_PROJECTION = np.random.default_rng(0).standard_normal((16 * 16 * 3, EMBEDDING_DIM)).astype(np.float32)


def pseudo_embedding(data: bytes) -> list[float] | None:
    """A deterministic 512-d stand-in for a source's CLIP column (random projection of a thumbnail).

    Similar pictures get similar vectors, which is all the explorer's nearest-neighbour search
    needs to be exercised offline. None when the bytes do not decode.
    """
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.draft("RGB", (64, 64))
            thumb = im.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
    except Exception:
        return None
    vec = (np.asarray(thumb, dtype=np.float32).reshape(-1) / 255.0 - 0.5) @ _PROJECTION
    return (vec / (np.linalg.norm(vec) + 1e-6)).tolist()


class SourceWriter(Protocol):
    def add(self, key: str, data: bytes, ext: str, caption: str) -> None: ...

    def close(self) -> None: ...


class ParquetSourceWriter:
    """Rows of (key, image bytes, caption, embedding) in parquet files of `rows_per_file`."""

    def __init__(self, folder: Path, rows_per_file: int = 80) -> None:
        self.folder, self.rows_per_file = folder, rows_per_file
        folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def add(self, key: str, data: bytes, ext: str, caption: str) -> None:
        self.rows.append({"key": key, "image": data, "caption": caption, "embedding": pseudo_embedding(data)})

    def close(self) -> None:
        schema = pa.schema(
            [
                ("key", pa.string()),
                ("image", pa.binary()),
                ("caption", pa.string()),
                ("embedding", pa.list_(pa.float32(), EMBEDDING_DIM)),
            ]
        )
        for part, start in enumerate(range(0, len(self.rows), self.rows_per_file)):
            chunk = self.rows[start : start + self.rows_per_file]
            table = pa.Table.from_pylist(chunk, schema=schema)
            pq.write_table(table, self.folder / f"part-{part:05d}.parquet", row_group_size=32)


class HuggingFaceSourceWriter:
    """A dataset as the Hugging Face Hub serves it: `data/train-0000K-of-0000N.parquet` with an
    `Image()` column (`struct<bytes, path>`, bytes embedded), the features in the schema's
    `huggingface` metadata (what `datasets` writes and reads), and a dataset card."""

    LICENSES = ("cc-by-4.0", "cc0-1.0", "cc-by-sa-4.0")

    def __init__(self, folder: Path, shards: int = 2) -> None:
        self.folder, self.shards = folder, shards
        (folder / "data").mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def add(self, key: str, data: bytes, ext: str, caption: str) -> None:
        license_ = self.LICENSES[len(self.rows) % len(self.LICENSES)]
        self.rows.append({"id": key, "image": {"bytes": data, "path": f"{key}.{ext}"}, "text": caption,
                          "license": license_})

    def close(self) -> None:
        features = {"id": {"dtype": "string", "_type": "Value"}, "image": {"_type": "Image"},
                    "text": {"dtype": "string", "_type": "Value"}, "license": {"dtype": "string", "_type": "Value"}}
        schema = pa.schema([("id", pa.string()), ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                            ("text", pa.string()), ("license", pa.string())],
                           metadata={"huggingface": json.dumps({"info": {"features": features}})})
        per = -(-len(self.rows) // self.shards)
        for shard in range(self.shards):
            table = pa.Table.from_pylist(self.rows[shard * per:(shard + 1) * per], schema=schema)
            pq.write_table(table, self.folder / "data" / f"train-{shard:05d}-of-{self.shards:05d}.parquet")
        (self.folder / "README.md").write_text(
            "---\nlicense: other\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
            "    path: data/train-*\n---\n# Demo photos\n\nScikit-image sample photos, captioned, as the Hub "
            "lays out a dataset.\n")


class FolderSourceWriter:
    """Image files with sidecar `.txt` captions, spread over a few sub-folders like a crawl dump."""

    def __init__(self, folder: Path, per_subfolder: int = 40) -> None:
        self.folder, self.per_subfolder, self.count = folder, per_subfolder, 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, data: bytes, ext: str, caption: str) -> None:
        sub = self.folder / f"batch_{self.count // self.per_subfolder:02d}"
        sub.mkdir(exist_ok=True)
        (sub / f"{key}.{ext}").write_bytes(data)
        (sub / f"{key}.txt").write_text(caption + "\n")
        self.count += 1

    def close(self) -> None:
        pass


class WebDatasetWriter:
    """WebDataset tar shards: members `<key>.<ext>` and `<key>.txt`, reproducible headers."""

    def __init__(self, folder: Path, per_shard: int = 60) -> None:
        self.folder, self.per_shard = folder, per_shard
        folder.mkdir(parents=True, exist_ok=True)
        self.samples: list[tuple[str, bytes, str, str]] = []

    def add(self, key: str, data: bytes, ext: str, caption: str) -> None:
        if "." in key:
            raise ValueError(f"WebDataset keys cannot contain dots: {key!r}")
        self.samples.append((key, data, ext, caption))

    def close(self) -> None:
        for shard, start in enumerate(range(0, len(self.samples), self.per_shard)):
            with tarfile.open(self.folder / f"shard-{shard:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for key, data, ext, caption in self.samples[start : start + self.per_shard]:
                    _add_member(tar, f"{key}.{ext}", data)
                    _add_member(tar, f"{key}.txt", caption.encode() + b"\n")


def _add_member(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644
    tar.addfile(info, io.BytesIO(payload))
