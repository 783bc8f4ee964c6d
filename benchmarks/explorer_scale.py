"""The explorer at PRX scale (issue 26): its pages over 100M synthetic `explorer` rows.

The explorer's pages read two tables only, `explorer` (one row per sample) and `explorer_facets`;
at 100M rows the upstream tables those are joined from (samples with image bytes, embeddings)
would take terabytes, so this writes the two tables directly, in the pipeline's schemas, source
by source in fragments of 1M rows (as the stage's commit leaves them after compaction), then
builds the indexes `refresh_table_indexes` builds. Facets are counted per fragment by the stage's
own `count_facets` and summed as its commit sums units. Generated once per size and cached under
`--cache` (the second run only measures); the generation time and disk use are printed.

Rows are realistic in shape, not in content: 64-hex content ids, Zipf words (short captions, so
the full-text index fits this machine's disk), 3% ingest rejects, 4% duplicate pairs, labels,
buckets, skip reasons. Pages measured through the app (`create_app` in a TestClient), each with
its raw Lance query in the same run: the home page, a text search, a filter by source + label, a
detail page; plus the process's peak RSS. Run:
`python -m benchmarks.explorer_scale --rows 100000000 --cache /var/tmp/prx-explorer-scale`.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.explorer_data import build_vocabulary, hex_strings, zipf_cdf
from benchmarks.explorer_pages import latency
from prx_core.stages.explorer.rows import count_facets, facet_rows, search_text
from prx_core.store import schemas
from prx_core.store.maintenance import refresh_table_indexes
from prx_core.store.storage import Storage

SEED = 26
FRAGMENT_ROWS = 1_000_000
SOURCES = (("laion_like", 0.55), ("stock", 0.25), ("web", 0.15), ("crawl", 0.05))
CAPTION_WORDS, ORIGINAL_WORDS = (8, 16), (3, 8)
LABELS = (("visual", 0.86), ("text", 0.09), ("nsfw", 0.03), ("other", 0.02))
REJECTS = ("too_small", "decode_error", "download_error")
BUCKETS = {256: ["256x256", "320x192", "192x320"], 512: ["512x512", "640x384", "384x640", "576x448"],
           1024: ["1024x1024", "1280x768", "768x1280", "1152x896", "896x1152", "1344x704"]}
QUERY_SOURCE, QUERY_LABEL = "stock", "text"


def word_lists(rng: np.random.Generator, vocab: pa.Array, cdf: np.ndarray, n: int, sizes: tuple[int, int]) -> pa.Array:
    lengths = rng.integers(sizes[0], sizes[1] + 1, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    words = np.searchsorted(cdf, rng.random(int(offsets[-1])), side="right").clip(0, len(vocab) - 1)
    return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), vocab.take(pa.array(words))), " ")


def fragment(rng: np.random.Generator, source: str, start: int, n: int, vocab: pa.Array, cdf: np.ndarray) -> pa.Table:
    """Rows `start`..`start + n` of `source`, sorted by sample_id as the stage writes a partition."""
    numbers = pc.utf8_lpad(pa.array(np.arange(start, start + n)).cast(pa.string()), 11, "0")
    sample_id = pc.binary_join_element_wise(pa.scalar(source), numbers, "/")
    stored = rng.random(n) >= 0.03
    width = rng.integers(300, 4000, n).astype(np.int32)
    height = (width * np.exp(rng.normal(0, 0.35, n))).clip(200, 5000).astype(np.int32)
    tier = np.where(np.sqrt(width.astype(float) * height) >= 900, 1024, np.where(width * height >= 300_000, 512, 256))
    names = {t: np.array(b, object) for t, b in BUCKETS.items()}
    bucket = np.empty(n, object)
    for t, choices in names.items():
        here = tier == t
        bucket[here] = choices[rng.integers(0, len(choices), int(here.sum()))]
    label = np.array([v for v, _ in LABELS], object)[rng.choice(len(LABELS), n, p=[p for _, p in LABELS])]
    pair = rng.random(n) < 0.04
    keeper = np.where(pair, np.arange(n) % 2 == 0, None)
    skip = np.where(pair & (keeper == False), "duplicate", None)  # noqa: E712 (object array)
    skip = np.where(label == "nsfw", np.where(skip == None, "nsfw", "duplicate,nsfw"), skip)  # noqa: E711
    caption = word_lists(rng, vocab, cdf, n, CAPTION_WORDS)
    null_str = pa.scalar(None, pa.string())
    on = pa.array(stored)
    columns = {
        "sample_id": sample_id, "source": pa.array([source] * n), "source_key": numbers,
        "content_id": pc.if_else(on, hex_strings(rng, n, 32), null_str), "stored": on,
        "width": width, "height": height,
        "format": pc.if_else(on, pa.array(np.array(["JPEG", "PNG", "WEBP"], object)[rng.integers(0, 3, n)]), null_str),
        "jpeg_quality": pa.array(rng.integers(60, 100, n).astype(np.int16)),
        "num_bytes": pa.array(rng.integers(20_000, 2_000_000, n)),
        "meta_label": pc.if_else(pa.array(rng.random(n) < 0.7), pc.binary_join_element_wise(
            pa.scalar("class"), pa.array(rng.zipf(1.3, n).clip(1, 999)).cast(pa.string()), ""), null_str),
        "original_caption": pc.if_else(on, word_lists(rng, vocab, cdf, n, ORIGINAL_WORDS), null_str),
        "reject_reason": pc.if_else(on, null_str, pa.array(np.array(REJECTS, object)[rng.integers(0, 3, n)])),
        "reject_stage": pc.if_else(on, null_str, pa.scalar("samples")),
        "reject_message": pc.if_else(on, null_str, pa.scalar("synthetic reject")),
        "tier": pc.if_else(on, pa.array(tier.astype(np.int32)), pa.scalar(None, pa.int32())),
        "bucket": pc.if_else(on, pa.array(bucket), null_str),
        "phash": hex_strings(rng, n, 8),
        "group_id": pc.if_else(pa.array(pair), pc.binary_join_element_wise(
            pa.scalar(source), pa.array(np.arange(start, start + n) // 2).cast(pa.string()), "#"), null_str),
        "group_size": pa.array(np.where(pair, 2, None), pa.int32()),
        "keeper": pa.array(keeper, pa.bool_()),
        "keeper_sample_id": pa.nulls(n, pa.string()),
        "captioner_version": pc.if_else(on, pa.scalar("cap-1"), null_str),
        "caption": pc.if_else(on, caption, null_str),
        "word_count": pc.if_else(on, pc.cast(pc.list_value_length(pc.split_pattern(caption, " ")), pa.int32()),
                                 pa.scalar(None, pa.int32())),
        "caption_error": pa.nulls(n, pa.string()),
        "label": pc.if_else(on, pa.array(label), null_str),
        "score": pa.array(rng.random(n).astype(np.float32)),
        "mds_index": pc.if_else(on, pa.array(np.arange(start, start + n)), pa.scalar(None, pa.int64())),
        "skip_reason": pa.array(skip, pa.string()),
    }
    columns["search_text"] = search_text(columns["caption"], columns["original_caption"])
    return schemas.table_of(columns, schemas.EXPLORER)


def source_sizes(rows: int) -> list[tuple[str, int]]:
    sizes = [(name, int(rows * share)) for name, share in SOURCES]
    return [(sizes[0][0], rows - sum(n for _, n in sizes[1:])), *sizes[1:]]


def fragments(rows: int) -> Iterator[tuple[str, int, int]]:
    """(source, first row, rows) of every fragment, source by source."""
    for source, size in source_sizes(rows):
        for start in range(0, size, FRAGMENT_ROWS):
            yield source, start, min(FRAGMENT_ROWS, size - start)


def generate(root: Path, rows: int) -> dict[str, float]:
    """Both tables and their indexes under `root`; returns the seconds each part took."""
    storage = Storage(str(root))
    rng = np.random.default_rng(SEED)
    vocab, cdf = build_vocabulary(), zipf_cdf()
    words = pa.array(vocab, pa.string())
    facets: dict[str, dict[str, Counter[str]]] = {}
    started, mode = time.perf_counter(), "overwrite"
    for i, (source, start, n) in enumerate(fragments(rows)):
        table = fragment(rng, source, start, n, words, cdf)
        for facet, counts in count_facets(table).items():
            facets.setdefault(source, {}).setdefault(facet, Counter()).update(counts)
        lance.write_dataset(table, storage.lance_uri("explorer"), mode=mode, max_rows_per_file=FRAGMENT_ROWS,
                            data_storage_version="stable")
        mode = "append"
        print(f"  fragment {i + 1}: {source} rows {start:,}..{start + n:,} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    written = time.perf_counter() - started
    lance.write_dataset(pa.concat_tables([facet_rows(s, c) for s, c in facets.items()]),
                        storage.lance_uri("explorer_facets"), mode="overwrite")
    started = time.perf_counter()
    refresh_table_indexes(storage.lance_uri("explorer"), "explorer")
    refresh_table_indexes(storage.lance_uri("explorer_facets"), "explorer_facets")
    return {"write_s": written, "index_s": time.perf_counter() - started}


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(root: Path, repeats: int) -> dict[str, object]:
    """p50/p95 of each page through the app and of its raw Lance query, and the peak RSS."""
    from starlette.testclient import TestClient

    from prx_explorer.app import create_app

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    client = TestClient(create_app(Storage(str(root)), ttl=3600), base_url="http://localhost")
    started = time.perf_counter()
    client.get("/healthz").raise_for_status()
    results: dict[str, object] = {"open_s": time.perf_counter() - started}
    table = lance.dataset(Storage(str(root)).lance_uri("explorer"))
    detail = table.to_table(columns=["sample_id"], filter=f"source = '{QUERY_SOURCE}'", limit=1)["sample_id"][0].as_py()
    term = "river"  # a caption word of rank ~90: in ~1% of captions
    where = f"source = '{QUERY_SOURCE}' AND label = '{QUERY_LABEL}'"
    pages = {
        "home": (("/", {}), lambda: lance.dataset(Storage(str(root)).lance_uri("explorer_facets")).to_table()),
        "text_search": (("/", {"q": term}), lambda: table.to_table(
            full_text_query=term, columns=["sample_id", "_score"], limit=48)),
        "filter_source_label": (("/", {"source": QUERY_SOURCE, "label": QUERY_LABEL}),
                                lambda: table.to_table(filter=where, limit=48)),
        "detail": (("/sample", {"id": detail}), lambda: table.to_table(
            filter=f"sample_id = '{detail}'", limit=1)),
    }
    explorer = client.app.state.explorer
    for name, ((path, params), _) in pages.items():
        def cold() -> None:  # a new query each time: nothing cached between requests
            explorer.queries.clear()
            client.get(path, params=params).raise_for_status()
        results[name] = latency(cold, repeats)
    # the app's peak, before the raw queries below open a second copy of the indexes' caches
    results["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["rss_before_app_mb"] = before / 1024
    for name, (_, raw) in pages.items():
        results[f"{name}_lance"] = latency(raw, repeats)
    return results


def format_table(rows: int, results: dict[str, object]) -> str:
    lines = [f"{rows:,} explorer rows: first open {results['open_s']:.2f} s, peak RSS {results['rss_mb']:.0f} MB "
             f"({results['rss_before_app_mb']:.0f} MB before the app)",
             "| page | p50 ms | p95 ms | raw Lance p50 ms | page / Lance |", "|---|---|---|---|---|"]
    for name in ("home", "text_search", "filter_source_label", "detail"):
        page, raw = results[name], results[f"{name}_lance"]
        lines.append(f"| {name} | {page['p50_ms']:.0f} | {page['p95_ms']:.0f} | {raw['p50_ms']:.1f} | "
                     f"{page['p50_ms'] / max(raw['p50_ms'], 1e-6):.1f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.explorer_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000_000)
    parser.add_argument("--cache", type=Path, default=Path("/var/tmp/prx-explorer-scale"),
                        help="where the generated tables stay between runs (one folder per size)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    root = args.cache / f"rows-{args.rows}"
    done = root / "generated.json"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"generating {args.rows:,} rows under {root} (once; later runs reuse it)", file=sys.stderr, flush=True)
        timings = generate(root, args.rows)
        timings["disk_gb"] = disk_bytes(root) / 1e9
        done.write_text(json.dumps(timings))
    generation = json.loads(done.read_text())
    print(f"generation: write {generation['write_s']:.0f} s, indexes {generation['index_s']:.0f} s, "
          f"{generation['disk_gb']:.1f} GB on disk", flush=True)
    results = measure(root, args.repeats)
    print(format_table(args.rows, results), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "generation": generation, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
