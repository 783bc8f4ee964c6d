"""What one content unit's key lookup reads from a shared table as the table grows (issue 41, item 2).

Per size N, one table of N rows keyed as the shared tables are (`content_id`: SHA-256 hex of
bytes, as `prx_core.sources.ingest.content_id` makes them), each row belonging to one of
`--sources` sources (a `source` column, as the per-source tables `buckets` and `samples` hold
every source's rows), with the indexes the pipeline builds (`prx_core.store.maintenance.
refresh_indexes`: a BTREE on `content_id`, a BITMAP on `source`), in fragments of 1M rows. Then
per unit, 4,096 content ids of one source, looked up three ways:

- **random** (the old units: a row range of a `samples` fragment holds random content ids):
  `content_id IN (...)` of 4,096 random keys of the source, through `lookup_literals` (what
  `lookup_keys` runs).
- **range keys** (the new units, `prx_core.stages.content_units`): the same lookup of 4,096 keys
  of the source that are consecutive in content order (a unit owns a range of content ids).
- **range read** (how a new unit finds its keys in a per-source table):
  `source = 's0' AND content_id >= lo AND content_id < hi` of that range.

Bytes are Lance's own read counters (`io_stats_incremental`: what an object store would serve; the
OS page cache does not hide them) and time, **cold** (a fresh `lance.Session` per unit: nothing
cached, the bound at PRX scale where the per-process cache holds ~0 of a 1B-row index) and
**worker** (`--units` units through one session with the pipeline's cache sizes,
`prx_core.store.lookups.lookup_session`: what a worker running unit after unit reads per unit).
Every lookup's rows are checked against the keys. A source holds 1/`--sources` of the table at
every size: its unit's range spans 4,096 x `--sources` rows of the table at every N.

`--keys caption` keys the table as the `source` captioner does (prx_core.models.caption_keys: the
content id, then a hash of content and text): a unit's keys are then its contents' caption keys,
consecutive because they sort by content. Under the earlier rule (the hash alone) the same unit's
caption keys were scattered over the key space, as the **random** pattern's are.

    python -m benchmarks.content_ranges [--rows 1000000,4000000,16000000] [--units 4] [--keys content|caption]
                                        [--json FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.index_segments import content_ids
from prx_core.models.caption_keys import source_caption_key
from prx_core.store.lance_io import sql_literal
from prx_core.store.lookups import LOOKUP_INDEX_CACHE_BYTES, LOOKUP_METADATA_CACHE_BYTES, lookup_literals
from prx_core.store.maintenance import refresh_indexes

FRAGMENT_ROWS = 1_000_000  # the shared tables' fragments (upkeep.appends.MERGE_ROWS)
WRITE_ROWS = 250_000
UNIT_KEYS = 4_096  # a content unit (prx_core.stages.contents.UNIT_ROWS)
PATTERNS = ("random", "range_keys", "range_read")
KEYS = ("content", "caption")  # the shared tables' key under a model captioner, and under the `source` one


def rows_of(start: int, n: int, sources: int, keys: str = "content") -> pa.Table:
    """Rows start..start+n: row i is source s{i % sources}, with a short caption like a stored one,
    keyed by its content id or (`keys="caption"`) by its caption key."""
    captions = [f"a photo of thing number {i}" for i in range(start, start + n)]
    ids = content_ids(start, n)
    if keys == "caption":
        ids = [source_caption_key(c, text) for c, text in zip(ids, captions)]
    return pa.table({"content_id": ids, "source": [f"s{i % sources}" for i in range(start, start + n)],
                     "caption": captions})


def build(uri: str, rows: int, sources: int, keys: str = "content") -> tuple[pa.Array, float]:
    """The table, indexed as the pipeline indexes it; (source s0's keys sorted, seconds)."""
    t0 = time.perf_counter()
    mine: list[pa.Array] = []
    for start in range(0, rows, WRITE_ROWS):
        batch = rows_of(start, min(WRITE_ROWS, rows - start), sources, keys)
        lance.write_dataset(batch, uri, mode="create" if start == 0 else "append", max_rows_per_file=FRAGMENT_ROWS)
        mine.append(batch.filter(pc.equal(batch["source"], "s0"))["content_id"].combine_chunks())
    refresh_indexes(uri, bitmap_columns=["source"], btree_columns=["content_id"])
    keys = pa.concat_arrays(mine)
    return keys.take(pc.sort_indices(keys)), time.perf_counter() - t0


def unit_keys(keys: pa.Array, rng: random.Random) -> dict[str, list[str]]:
    """One unit's 4,096 keys of source s0 in each pattern: random ones, and consecutive ones."""
    start = rng.randrange(0, len(keys) - UNIT_KEYS)
    return {"random": [keys[i].as_py() for i in sorted(rng.sample(range(len(keys)), UNIT_KEYS))],
            "range": keys.slice(start, UNIT_KEYS + 1).to_pylist()}  # the last one: the range's end


def lookup(ds: lance.LanceDataset, pattern: str, keys: dict[str, list[str]]) -> tuple[int, float]:
    """Bytes read and seconds of one unit's lookup; the rows found must be exactly the unit's keys."""
    if pattern == "range_read":
        want = keys["range"][:-1]
        lo, hi = sql_literal(want[0]), sql_literal(keys["range"][-1])
        run: Callable[[], pa.Table] = lambda: ds.to_table(  # noqa: E731
            columns=["content_id", "caption"], filter=f"source = 's0' AND content_id >= {lo} AND content_id < {hi}")
    else:
        want = keys["random"] if pattern == "random" else keys["range"][:-1]
        literals = [sql_literal(k) for k in want]
        run = lambda: lookup_literals(ds, "content_id", literals, ["content_id", "caption"])  # noqa: E731
    ds.io_stats_incremental()
    t0 = time.perf_counter()
    found = run()
    seconds = time.perf_counter() - t0
    read = ds.io_stats_incremental().read_bytes
    if pattern != "range_read":
        found = found.filter(pc.is_in(found["content_id"], pa.array(want)))
    if sorted(found["content_id"].to_pylist()) != sorted(want):
        raise AssertionError(f"{pattern}: found {found.num_rows} rows, not the unit's {len(want)} keys")
    return read, seconds


def session() -> lance.Session:
    return lance.Session(index_cache_size_bytes=LOOKUP_INDEX_CACHE_BYTES,
                         metadata_cache_size_bytes=LOOKUP_METADATA_CACHE_BYTES)


def measure(uri: str, keys: pa.Array, units: int, seed: int) -> dict[str, dict[str, float]]:
    """Per pattern: median cold unit (fresh session each) and mean unit of `units` through one session."""
    rng = random.Random(seed)
    plans = [unit_keys(keys, rng) for _ in range(units)]
    result: dict[str, dict[str, float]] = {}
    for pattern in PATTERNS:
        cold = []
        for plan in plans:
            ds = lance.dataset(uri, session=session())
            ds.io_stats_incremental()  # the open's manifest read is not the unit's
            cold.append(lookup(ds, pattern, plan))
        ds = lance.dataset(uri, session=session())
        ds.io_stats_incremental()
        worker = [lookup(ds, pattern, plan) for plan in plans]
        result[pattern] = {"cold_mb": round(statistics.median(b for b, _ in cold) / 1e6, 2),
                           "cold_ms": round(statistics.median(s for _, s in cold) * 1e3, 1),
                           "worker_mb": round(statistics.mean(b for b, _ in worker) / 1e6, 2),
                           "worker_ms": round(statistics.mean(s for _, s in worker) * 1e3, 1)}
    return result


def run_size(base: str, rows: int, sources: int, units: int, keys: str = "content") -> dict[str, Any]:
    print(f"{rows:,} rows of {sources} sources, keyed by {keys}: writing and indexing ...", flush=True)
    uri = os.path.join(base, f"shared_{rows}.lance")
    try:
        sorted_keys, build_s = build(uri, rows, sources, keys)
        index_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(uri, "_indices"))
                       for f in fs) / 1e6
        return {"rows": rows, "sources": sources, "keys": keys, "build_s": round(build_s, 1),
                "index_mb": round(index_mb, 1), "lookups": measure(uri, sorted_keys, units, seed=rows)}
    finally:
        shutil.rmtree(uri, ignore_errors=True)


def growth(sizes: list[dict[str, Any]]) -> dict[str, float]:
    """Largest over smallest table: cold bytes per unit of each pattern."""
    first, last = sizes[0]["lookups"], sizes[-1]["lookups"]
    return {p: round(last[p]["cold_mb"] / max(first[p]["cold_mb"], 1e-9), 2) for p in PATTERNS}


def format_size(size: dict[str, Any]) -> str:
    lines = [f"{size['rows']:,} rows ({size['sources']} sources, keyed by {size['keys']}), index {size['index_mb']} MB, built in "
             f"{size['build_s']} s:", "| pattern | cold MB / ms | worker MB / ms |"]
    for pattern, got in size["lookups"].items():
        lines.append(f"| {pattern} | {got['cold_mb']} / {got['cold_ms']} | {got['worker_mb']} / {got['worker_ms']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1000000,4000000", help="comma-separated table sizes")
    parser.add_argument("--sources", type=int, default=10, help="sources sharing the table (a source's share)")
    parser.add_argument("--units", type=int, default=4, help="units measured per pattern and size")
    parser.add_argument("--keys", choices=KEYS, default="content",
                        help="the table's key: content ids (model captioners) or caption keys (the source captioner)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dir", default=None, help="where the tables are built (removed afterwards)")
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="content_ranges_", dir=args.dir)
    try:
        results: dict[str, Any] = {"lance": lance.__version__, "cpus": os.cpu_count(), "sizes": []}
        for rows in (int(r) for r in args.rows.split(",")):
            size = run_size(base, rows, args.sources, args.units, args.keys)
            results["sizes"].append(size)
            print(format_size(size), flush=True)
        results["growth"] = growth(results["sizes"])
        print("cold bytes per unit, largest table / smallest: "
              + ", ".join(f"{p} {g}x" for p, g in results["growth"].items()), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
