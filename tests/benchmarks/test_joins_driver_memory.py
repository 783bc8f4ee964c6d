"""The bounded-driver rule for joins: `samples` of a joined source (images, captions and 512-d CLIP
vectors in three tables, the vectors written by lancedb) at two sizes, each driver in a process of
its own (benchmarks.scale_driver, as `prx-bench scale` runs it), and its peak RSS compared.

The larger source holds 8,000 more rows than the smaller one (~23 MB more in its three tables,
most of it CLIP vectors), so a driver that loaded a joined table, or the source, would grow by
tens of MB (as Python lists, hundreds); staging and ingest run as work units, and the driver grew
by 2.5 MB when this was written. Half the added bytes is the bound, as in test_scale_bench.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.scale_driver import Cluster, run_driver
from prx_core.demo.photos import load_skimage_photos
from prx_core.sources.catalog import load_catalog

SMALL, LARGE, FILE_ROWS = 2_000, 10_000, 1_000
MISSING, REPEATED = 7, 11  # every 7th key has no caption; every 11th has a second CLIP row


def write_source(root: Path, rows: int) -> Path:
    """images/ (id, a 64x48 crop of a real photo), captions/ (id, caption), clip/ (lancedb, id, clip);
    returns the catalog file."""
    import lancedb

    photos = [p.image.convert("RGB") for p in load_skimage_photos()]
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "captions").mkdir()
    for start in range(0, rows, FILE_ROWS):
        ids = [f"k{i:06d}" for i in range(start, min(rows, start + FILE_ROWS))]
        images = []
        for i in range(start, start + len(ids)):
            photo = photos[i % len(photos)]
            x, y = int(rng.integers(0, photo.width - 64)), int(rng.integers(0, photo.height - 48))
            buffer = io.BytesIO()
            photo.crop((x, y, x + 64, y + 48)).save(buffer, format="JPEG", quality=85)
            images.append(buffer.getvalue())
        pq.write_table(pa.table({"id": ids, "image": pa.array(images, pa.binary())}),
                       root / "images" / f"part-{start // FILE_ROWS:05d}.parquet")
        kept = [k for n, k in enumerate(ids, start) if n % MISSING]
        pq.write_table(pa.table({"id": kept, "caption": [f"a small crop of a photo, number {k}" for k in kept]}),
                       root / "captions" / f"part-{start // FILE_ROWS:05d}.parquet")
    clip_ids = [f"k{i:06d}" for i in range(rows)] + [f"k{i:06d}" for i in range(0, rows, REPEATED)]
    vectors = rng.random((len(clip_ids), 512), dtype=np.float32)
    table = pa.table({"id": clip_ids, "clip": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 512)})
    lancedb.connect(str(root / "clip")).create_table("clip", table)
    catalog = root / "sources.yaml"
    catalog.write_text(
        "sources:\n"
        "  - {name: joined, format: parquet, uri: images, image_column: image, key_column: id,\n"
        "     joins: [{uri: captions, key_column: id, caption_column: caption},\n"
        "             {uri: clip/clip.lance, key_column: id, embedding_column: clip}]}\n")
    return catalog


def folder_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def measure(base: Path) -> dict[int, dict]:
    """Both sizes' driver results, each driver in a process of its own on one Ray started here."""
    cluster = Cluster(cpus=2, fresh=False)
    results = {}
    try:
        for rows in (SMALL, LARGE):
            catalog = write_source(base / f"data-{rows}", rows)
            spec = load_catalog(catalog).get("joined")
            files = sorted((base / f"data-{rows}" / "images").glob("*.parquet"))
            unit_bytes = int(2.5 * sum(f.stat().st_size for f in files) / len(files))  # two files a unit
            with cluster.session() as address:
                results[rows] = run_driver({"stage": "samples", "root": str(base / f"corpus-{rows}"),
                                            "address": address, "source": spec.to_dict(),
                                            "units": {"samples_unit_bytes": unit_bytes}})
    finally:
        cluster.close()
    return results


def test_the_driver_of_a_joined_source_stays_bounded(tmp_path: Path) -> None:
    # in a process of its own: the benchmark starts its own Ray, and this test session may hold one already
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_joins_driver_memory as t; "
            "from pathlib import Path; print(json.dumps(t.measure(Path(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path)], capture_output=True,
                          text=True, timeout=1200, env=os.environ.copy(), cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    results = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    sizes = {rows: folder_mb(tmp_path / f"data-{rows}") for rows in (SMALL, LARGE)}
    small, large = results[SMALL], results[LARGE]
    assert (small["rows"], large["rows"]) == (SMALL, LARGE)
    assert large["extra"]["rejected"] == len(range(0, LARGE, REPEATED))  # each repeated CLIP row, refused
    assert large["units"]["units"]["units"] == LARGE // FILE_ROWS // 2
    added_mb = sizes[LARGE] - sizes[SMALL]
    assert added_mb > 20, sizes
    growth = large["driver_peak_rss_mb"] - small["driver_peak_rss_mb"]
    assert 50 < small["driver_peak_rss_mb"] < 4096
    assert growth < added_mb / 2, (small["driver_peak_rss_mb"], large["driver_peak_rss_mb"], added_mb)
