"""Download benchmark: the `samples` stage over a URL table fetched from a loopback HTTP server,
against the same stage over a parquet table holding the same image bytes, in the same run.

Both sources have the same rows (keys, captions, images: real-photo JPEGs of 512 px, ~40-60 KB)
in the same number of files, one work unit per file, on the benchmark's own local Ray. The URL
source's workers fetch every image from a `ThreadingHTTPServer` on 127.0.0.1 in this process
(keep-alive, no faults) with the default `DownloadSettings` (one host: `per_host` is the bound);
the plain source reads the bytes from its parquet files. Both then validate, hash and write
identically, so `ratio` (download rate / plain rate) is what fetching costs the stage when the
network is free: a floor on what a real network adds (a worker fetches a batch, then ingests it).
`fetch_only` times the fetching alone, batch by batch in this process. The server shares the
machine's cores with the workers, as it would not in production.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prx_core.sources.catalog import DownloadSettings, SourceSpec
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage


def make_images(count: int = 24, side: int = 512) -> list[bytes]:
    """`count` distinct JPEG q85 crops of scikit-image's photos, at most `side` px."""
    from PIL import Image

    from prx_core.demo.photos import load_skimage_photos

    photos = [p.image.convert("RGB") for p in load_skimage_photos()]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        shrink = 1 - 0.04 * (i // len(photos))
        crop = photo.crop((0, 0, max(64, int(photo.width * shrink)), max(64, int(photo.height * shrink))))
        crop.thumbnail((side, side), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


class _Images(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall between
    timeout = 30

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        images = self.server.images  # type: ignore[attr-defined]
        try:
            data = images[int(self.path.rsplit("/", 1)[-1].split(".")[0]) % len(images)]
        except ValueError:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(images: list[bytes]) -> ThreadingHTTPServer:
    """A loopback server answering `/img/<n>.jpg` with image n (mod their count), in a daemon thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    server.images = images  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def write_sources(folder: Path, images: list[bytes], rows: int, files: int, port: int) -> tuple[SourceSpec, SourceSpec]:
    """The URL table and the bytes table of the same `rows` rows, `files` parquet files each."""
    for name in ("urls", "bytes"):
        (folder / name).mkdir(parents=True)
    per_file = -(-rows // files)
    for f in range(files):
        picks = range(f * per_file, min(rows, (f + 1) * per_file))
        keys, captions = [f"k{i:07d}" for i in picks], [f"photo {i}" for i in picks]
        urls = [f"http://127.0.0.1:{port}/img/{i}.jpg" for i in picks]
        pq.write_table(pa.table({"key": keys, "url": urls, "caption": captions}),
                       folder / "urls" / f"part-{f:04d}.parquet")
        data = [images[i % len(images)] for i in picks]
        pq.write_table(pa.table({"key": keys, "image": pa.array(data, pa.binary()), "caption": captions}),
                       folder / "bytes" / f"part-{f:04d}.parquet")
    common = {"caption_column": "caption", "key_column": "key"}
    loopback = DownloadSettings(allow_networks=("127.0.0.1/32",))  # the benchmark's own server: opted in
    return (SourceSpec("fetched", "parquet", str(folder / "urls"), url_column="url", download=loopback, **common),
            SourceSpec("plain", "parquet", str(folder / "bytes"), image_column="image", **common))


def measure(spec: SourceSpec, root: Path) -> dict[str, Any]:
    started = time.monotonic()
    report = build_samples(spec, Storage(str(root)), unit_bytes=1)  # one unit per file, for both sources
    seconds = time.monotonic() - started
    return {"rows": report.rows, "rejected": report.rejected, "units": report.units.units, "seconds": round(seconds, 3),
            "images_per_s": round((report.rows + report.rejected) / max(seconds, 1e-9), 1), "reasons": report.reasons}


def measure_fetch(spec: SourceSpec) -> dict[str, Any]:
    """The fetching alone, in this process, one window per file as a worker fetches (no decode, no write)."""
    from prx_core.sources.fetch.window import fetch_http

    started, fetched, urls = time.monotonic(), 0, []
    for path in sorted(Path(spec.uri).glob("*.parquet")):
        file_urls = pq.read_table(path)["url"].to_pylist()
        urls += file_urls
        fetched += sum(f.data is not None for f in fetch_http(file_urls, spec.download, spec.max_image_bytes))
    seconds = time.monotonic() - started
    return {"fetched": fetched, "seconds": round(seconds, 3), "images_per_s": round(len(urls) / max(seconds, 1e-9), 1)}


def run(images: int = 6000, files: int = 12, cpus: int | None = None, workdir: str | None = None) -> dict[str, Any]:
    """Both measurements in one Ray (warmed up first with a small build of each), plain first."""
    import os
    import shutil

    import ray

    cpus = cpus or min(4, os.cpu_count() or 1)
    if ray.is_initialized():
        raise RuntimeError("the download benchmark starts its own Ray: run it in a process without one")
    work = Path(workdir or tempfile.mkdtemp(prefix="prx-bench-download-"))
    server = serve(make_images())
    warnings.filterwarnings("ignore", message="lance is not fork-safe")
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="warning",
             configure_logging=False)
    try:
        port = server.server_address[1]
        warm_fetched, warm_plain = write_sources(work / "warm", server.images, 2 * cpus, cpus, port)
        measure(warm_plain, work / "warm" / "plain_corpus")
        measure(warm_fetched, work / "warm" / "fetched_corpus")
        fetched, plain = write_sources(work / "sources", server.images, images, files, port)
        mean_bytes = sum(map(len, server.images)) // len(server.images)
        results = {"images": images, "files": files, "cpus": cpus, "image_bytes": mean_bytes,
                   "settings": {"concurrency": fetched.download.concurrency, "per_host": fetched.download.per_host}}
        results["plain"] = measure(plain, work / "plain_corpus")
        results["download"] = measure(fetched, work / "fetched_corpus")
        results["fetch_only"] = measure_fetch(fetched)
        results["ratio"] = round(results["download"]["images_per_s"] / max(results["plain"]["images_per_s"], 1e-9), 3)
        return results
    finally:
        ray.shutdown()
        server.shutdown()
        server.server_close()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def format_table(r: dict[str, Any]) -> str:
    lines = [f"download benchmark: {r['images']} images (~{r['image_bytes'] // 1000} KB JPEG) in {r['files']} files, "
             f"{r['cpus']} Ray CPUs, concurrency {r['settings']['concurrency']} per worker, loopback server",
             "", f"{'source':<26}{'images/s':>10}{'seconds':>10}{'samples':>9}{'rejects':>9}"]
    for name, label in (("plain", "parquet of bytes"), ("download", "URL table, fetched")):
        m = r[name]
        lines.append(f"{label:<26}{m['images_per_s']:>10.1f}{m['seconds']:>10.1f}{m['rows']:>9}{m['rejected']:>9}")
    f = r["fetch_only"]
    lines.append(f"{'fetching alone (1 core)':<26}{f['images_per_s']:>10.1f}{f['seconds']:>10.1f}{f['fetched']:>9}")
    lines.append(f"\ndownload + ingest runs at {r['ratio']:.2f}x the rate of plain ingest of the same bytes")
    return "\n".join(lines)
