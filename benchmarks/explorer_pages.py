"""Explorer page latency end to end: `prx-corpus browse`'s app over synthetic corpus tables in the
pipeline's own schemas, against the raw Lance query each page is built on (same run).

The corpus's `explorer` rows and facets are written by the pipeline's own stage (`build_explorer`,
per source, on an embedded Ray), as the `explorer` asset writes them. The raw query is the floor:
what is left is the explorer's filter building, menu counts, page read and template.
Run: `python -m benchmarks.explorer_pages --rows 100000 [--json FILE]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from prx_core.stages.explorer.stage import build_explorer
from prx_core.stages.source_embeddings import fixed_size_vectors
from prx_core.store import schemas
from prx_core.store.maintenance import refresh_table_indexes
from prx_core.store.storage import Storage

WORDS = [f"word{i}" for i in range(5000)] + ["astronaut", "rocket", "harbour", "lighthouse"]
SOURCES = ("crawl", "stock", "web")


def write_corpus(root: Path, rows: int, seed: int = 0) -> None:
    """samples, buckets, captions, caption_labels, duplicates, mds_index and caption_embeddings with
    30-word captions, 5% of samples in duplicate pairs, indexes as the pipeline builds them, then
    each source's `explorer` rows and facets by the pipeline's stage."""
    rng = np.random.default_rng(seed)
    ids = [f"{SOURCES[i % 3]}/k{i:08d}" for i in range(rows)]
    cids, src = [f"{i:064x}" for i in range(rows)], [SOURCES[i % 3] for i in range(rows)]
    width, height = rng.integers(300, 4000, rows).astype(np.int32), rng.integers(300, 4000, rows).astype(np.int32)
    words = np.array(WORDS)
    captions = [" ".join(rng.choice(words, 30)) for _ in range(rows)]
    tier = np.where(np.sqrt(width.astype(float) * height) >= 768, 1024, 512).astype(np.int32)
    bucket = [f"{t}x{t}" for t in tier]
    pairs = rows // 20
    vectors = rng.standard_normal((rows, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    tables = {
        "samples": {"sample_id": ids, "content_id": cids, "source": src, "source_key": ids, "image": [b""] * rows,
                    "width": width, "height": height, "format": ["JPEG"] * rows, "mode": ["RGB"] * rows,
                    "orientation": pa.array([1] * rows, pa.int8()), "jpeg_quality": pa.array([90] * rows, pa.int16()),
                    "num_bytes": pa.array([1000] * rows, pa.int64()), "original_caption": captions,
                    "embedding": pa.nulls(rows, pa.list_(pa.float32())), "phash": pa.nulls(rows, pa.uint64()),
                    "metadata": pa.array([[("label", f"class{i % 20}"), ("license", "cc-by")] for i in range(rows)],
                                         schemas.SAMPLES.field("metadata").type),
                    "source_url": [f"https://example.org/{i}.jpg" for i in range(rows)]},
        "buckets": {"sample_id": ids, "source": src, "content_id": cids, "width": width, "height": height, "tier": tier,
                    "bucket_width": tier, "bucket_height": tier, "bucket": bucket, "drop_reason": pa.nulls(rows, pa.string())},
        "captions": {"content_id": cids, "captioner_version": ["c1"] * rows, "captioner_id": ["c"] * rows,
                     "prompt_version": ["p"] * rows, "caption": captions, "word_count": pa.array([30] * rows, pa.int32()),
                     "error": [""] * rows},
        "caption_labels": {"content_id": cids, "captioner_version": ["c1"] * rows, "labeler_version": ["l1"] * rows,
                           "labeler_id": ["m"] * rows, "label": rng.choice(["visual", "text", "nsfw"], rows, p=[.9, .08, .02]),
                           "score": pa.array(rng.random(rows), pa.float32())},
        "duplicates": {"sample_id": ids[:2 * pairs], "source": src[:2 * pairs],
                       "group_id": [f"{i // 2:016x}" for i in range(2 * pairs)],
                       "group_size": pa.array([2] * 2 * pairs, pa.int32()), "keeper": [i % 2 == 0 for i in range(2 * pairs)],
                       "keeper_sample_id": [ids[i - i % 2] for i in range(2 * pairs)],
                       "pixels": pa.array([1] * 2 * pairs, pa.int64())},
        "mds_index": {"sample_id": ids, "source": src, "content_id": cids, "tier": tier, "bucket": bucket,
                      "index": pa.array(range(rows), pa.int64()), "image_sha256": cids, "captioner_version": ["c1"] * rows},
        "caption_embeddings": {"content_id": cids, "captioner_version": ["c1"] * rows, "embedder_version": ["e1"] * rows,
                               "embedder_id": ["m"] * rows,
                               "embedding": fixed_size_vectors(vectors)},
    }
    storage = Storage(str(root))
    for name, columns in tables.items():
        lance.write_dataset(schemas.table_of(columns, schemas.TABLES[name]), storage.lance_uri(name), mode="overwrite",
                            max_rows_per_file=1_000_000)
    for name in tables:
        refresh_table_indexes(storage.lance_uri(name), name)
    write_explorer(storage)


def write_explorer(storage: Storage) -> None:
    """Every source's `explorer` partition, by the stage the asset runs (Ray tasks on an embedded Ray)."""
    import ray

    from prx_core.compute.quiet import start_ray

    start_ray(num_cpus=2)
    try:
        for source in SOURCES:
            build_explorer(source, storage, captioner_version="c1", labeler_version="l1")
    finally:
        ray.shutdown()


def latency(call: Callable[[], object], repeats: int) -> dict[str, float]:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]}


def measure(root: Path, repeats: int) -> dict[str, object]:
    from starlette.testclient import TestClient

    from prx_explorer.app import create_app

    client = TestClient(create_app(Storage(str(root)), ttl=3600), base_url="http://localhost")  # an allowed Host
    start = time.perf_counter()
    client.get("/healthz")
    view = client.app.state.explorer.views.get()
    results: dict[str, object] = {"open_s": time.perf_counter() - start,
                                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rows, embeddings = view.table("explorer"), view.table("caption_embeddings")
    vector = np.asarray(embeddings.to_table(columns=["embedding"], limit=1)["embedding"][0].as_py(), np.float32)
    floors = {"fts": lambda: rows.to_table(full_text_query="astronaut", columns=["sample_id", "_score"], limit=2000),
              "nn": lambda: embeddings.to_table(nearest={"column": "embedding", "q": vector, "k": 201, "nprobes": 20,
                                                         "refine_factor": 10}, columns=["content_id", "_distance"]),
              "page": lambda: rows.to_table(filter="source = 'web' AND tier = 1024 AND label = 'text'", limit=48),
              "meta": lambda: rows.to_table(columns=["sample_id"], filter="meta_label = 'class3'", limit=48)}
    like = rows.to_table(columns=["sample_id"], limit=1)["sample_id"][0].as_py()
    pages = {"browse": ("/", {}, None), "browse_page_50": ("/", {"page": "50"}, None),
             "filters": ("/", {"source": "web", "tier": "1024", "label": "text"}, "page"),
             "text_search": ("/", {"q": "astronaut"}, "fts"), "text_search_filtered": ("/", {"q": "rocket", "source": "stock"}, "fts"),
             "more_like_this": ("/", {"like": like}, "nn"), "detail": ("/sample", {"id": like}, None),
             "meta_filter": ("/", {"meta": "label:class3"}, "meta"), "meta_other_key": ("/", {"meta": "license:cc-by"}, None)}
    explorer = client.app.state.explorer
    for name, (path, params, floor) in pages.items():
        def cold() -> None:  # every request recomputes the match, as a new query would
            explorer.queries.clear()
            client.get(path, params=params).raise_for_status()
        page = latency(cold, repeats)
        results[name] = page
        if floor is not None:
            raw = latency(floors[floor], repeats)
            results[f"{name}_lance"] = raw
            results[f"{name}_over_lance"] = page["p50_ms"] / raw["p50_ms"]
    return results


def format_table(rows: int, results: dict[str, object]) -> str:
    lines = [f"{rows:,} rows: first open of the tables {results['open_s']:.2f} s "
             f"(process peak RSS {results['rss_mb']:.0f} MB, writing included)",
             "| page | p50 ms | p95 ms | raw Lance p50 ms | page / Lance |", "|---|---|---|---|---|"]
    for name, value in results.items():
        if isinstance(value, dict) and not name.endswith("_lance"):
            raw = results.get(f"{name}_lance")
            extra = (f"{raw['p50_ms']:.1f} | {results[f'{name}_over_lance']:.1f}x" if isinstance(raw, dict) else " | ")
            lines.append(f"| {name} | {value['p50_ms']:.0f} | {value['p95_ms']:.0f} | {extra} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.explorer_pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000", help="comma-separated corpus sizes (default 100000)")
    parser.add_argument("--repeats", type=int, default=20, help="timed requests per page (default 20)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    report = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        with tempfile.TemporaryDirectory(prefix="prx-pages-") as folder:
            start = time.perf_counter()
            write_corpus(Path(folder), rows)
            print(f"wrote and indexed {rows:,} rows in {time.perf_counter() - start:.0f} s", flush=True)
            report[str(rows)] = measure(Path(folder), args.repeats)
            print(format_table(rows, report[str(rows)]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
