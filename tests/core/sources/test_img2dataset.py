"""img2dataset's output, written by the real tool against the loopback photo server (some URLs
failing), built through the real `samples` stage: its WebDataset tars and its parquet files give
the photos it fetched; the rows it failed to fetch (kept in its parquet with `error_message`)
become `download_error` rejects carrying img2dataset's message. And what its default resize does:
256x256 output, under the 384x384 floor, hence `resize_mode="no"` in docs/sources.md."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from http_server import PhotoServer
from PIL import Image

from prx_core.image.buckets import FLOOR_SIDE
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store import lance_io
from prx_core.store.storage import Storage

assert os.environ["NO_ALBUMENTATIONS_UPDATE"] == "1"  # tests/conftest.py: albumentations must not ask PyPI

PATHS = ["/photo/astronaut/a", "/missing/b", "/photo/coffee/c", "/fail/d", "/photo/motorcycle_left/e"]
FAILED = {"/missing/b": "HTTP Error 404: Not Found", "/fail/d": "HTTP Error 503: Service Unavailable"}


def run_img2dataset(photo_server: PhotoServer, folder: Path, output_format: str, **options) -> Path:
    """img2dataset over PATHS (a parquet URL list with captions); its output folder."""
    import img2dataset

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"url": photo_server.url(p), "caption": f"caption of {p}"} for p in PATHS]
    pq.write_table(pa.Table.from_pylist(rows), folder / "urls.parquet")
    out = folder / output_format
    img2dataset.download(url_list=str(folder / "urls.parquet"), input_format="parquet", url_col="url",
                         caption_col="caption", output_format=output_format, output_folder=str(out),
                         processes_count=1, thread_count=2, enable_wandb=False, distributor="multiprocessing",
                         timeout=5, retries=0, **{"resize_mode": "no", "skip_reencode": True, **options})
    return out


def built(spec: SourceSpec, root: Path) -> tuple[dict[str, dict], dict[str, tuple[str, str]]]:
    """`build_samples` of `spec`: its samples and its rejects (reason, message) by source key."""
    storage = Storage(str(root))
    build_samples(spec, storage)
    samples = lance_io.read_table(storage.lance_uri("samples"), ["source_key", "image", "original_caption", "width"])
    rejects = lance_io.read_table(storage.lance_uri("rejects"), ["source_key", "reason", "message"])
    return ({r["source_key"]: r for r in samples.to_pylist()},
            {r["source_key"]: (r["reason"], r["message"]) for r in rejects.to_pylist()})


def test_img2dataset_tars_and_parquet_build_and_its_failures_are_rejects_with_its_message(
        tmp_path: Path, photo_server: PhotoServer, served_photos: dict[str, bytes], ray_cluster) -> None:
    fetched = {f"{i:09d}": p for i, p in enumerate(PATHS) if p not in FAILED}  # img2dataset's keys: row numbers
    failed = {f"{i:09d}": FAILED[p] for i, p in enumerate(PATHS) if p in FAILED}

    tars = run_img2dataset(photo_server, tmp_path / "wds", "webdataset")
    samples, rejects = built(SourceSpec("i2d_wds", "webdataset", str(tars)), tmp_path / "corpus_wds")
    assert sorted(samples) == sorted(fetched) and rejects == {}  # its tars hold the fetched rows only
    for key, path in fetched.items():
        assert samples[key]["image"] == served_photos[path.split("/")[2]]  # resize_mode="no", skip_reencode: its bytes
        assert samples[key]["original_caption"] == f"caption of {path}"

    table = run_img2dataset(photo_server, tmp_path / "pq", "parquet")
    spec = SourceSpec("i2d_pq", "parquet", str(table), image_column="jpg", key_column="key", caption_column="caption")
    samples, rejects = built(spec, tmp_path / "corpus_pq")
    assert sorted(samples) == sorted(fetched)
    assert all(samples[k]["image"] == served_photos[p.split("/")[2]] for k, p in fetched.items())
    assert rejects == {k: ("download_error", f"not downloaded by the tool that wrote the source: {message}")
                       for k, message in failed.items()}


def test_img2dataset_default_resize_falls_under_the_floor(tmp_path: Path, photo_server: PhotoServer) -> None:
    """Its defaults (resize_mode="border", image_size=256) pad every photo into 256x256: under the
    384x384 floor, so every sample would be dropped as below_floor; `resize_mode="no"` keeps them."""
    out = run_img2dataset(photo_server, tmp_path / "default", "parquet", resize_mode="border", skip_reencode=False)
    columns = ["jpg", "status", "original_width", "original_height"]
    table = pq.read_table(next(out.glob("*.parquet")), columns=columns).to_pylist()
    sizes = {Image.open(io.BytesIO(r["jpg"])).size for r in table if r["status"] == "success"}
    assert sizes == {(256, 256)} and 256 < FLOOR_SIDE == 384
    originals = [(r["original_width"] * r["original_height"]) ** 0.5 for r in table if r["status"] == "success"]
    assert len(originals) == 3 and min(originals) >= FLOOR_SIDE  # the photos themselves were over it
