"""Key lookups against a shared table's BTREE index: bounded segments vs a delta per catch-up
(issue 41, item 3).

For each size N, two tables get the same rows through the same appends (N / `--catch-ups` rows
each, written as the pipeline's batched appends leave them: fragments of up to 1M rows), each
append followed by an index catch-up:

- `old`: what the stage catch-ups did: the new fragments indexed as a delta segment of their own
  (`mergeable_segments` with no row budget: the number of segments grows with the history);
- `bounded`: `prx_core.store.maintenance.catch_up_indexes` (prx_core.store.segments: newest
  segments folded by a 4x size ratio, at most `MAX_SEGMENTS`).

Keys are content ids as the pipeline makes them (SHA-256 hex of bytes). Then, on each table, a
lookup of 5 keys and of 4,096 random keys (`content_id IN (...)`, the rows compared with what was
written): bytes read as Lance counts them (`io_stats_incremental`: what an object store would
serve; the OS page cache does not hide it) and time, cold (a freshly opened table: index pages
not cached) and warm (the same open table, other keys). Each is the median of `--repeats`. The
lookup reads only `n` besides the filter: the rows' other columns cost the same under any index
layout (the 4,096 rows' `content_id` strings are ~50 MB of pages at 1M rows), the index's reads
are what its segments change.

    python -m benchmarks.index_segments [--rows 1000000,4000000,16000000] [--catch-ups 64] [--json FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lance
import pyarrow as pa

from prx_core.store.maintenance import catch_up_indexes, mergeable_segments
from prx_core.store.segments import MAX_SEGMENTS
from prx_core.upkeep.appends import keys_predicate

INDEX = "content_id_btree"
FRAGMENT_ROWS = 1_000_000  # the shared tables' fragments (upkeep.appends.MERGE_ROWS)
LOOKUPS = {"5_keys": 5, "4096_keys": 4_096}


def content_ids_at(positions: Iterable[int]) -> list[str]:
    """Content ids of the rows at `positions` (prx_core.sources.ingest.content_id of made-up bytes)."""
    return [hashlib.sha256(b"image-%d" % i).hexdigest() for i in positions]


def content_ids(start: int, n: int) -> list[str]:
    return content_ids_at(range(start, start + n))


def rows_of(start: int, n: int) -> pa.Table:
    return pa.table({"content_id": content_ids(start, n), "n": pa.array(range(start, start + n), pa.int64())})


def catch_up_old(ds: lance.LanceDataset) -> None:
    """The stage catch-up before bounded segments: the newest segments within no row budget (none)."""
    desc = next(d for d in ds.describe_indices() if d.name == INDEX)
    rows = {f.fragment_id: f.metadata.num_rows for f in ds.get_fragments()}
    newest = mergeable_segments([s.fragment_ids for s in desc.segments], rows, 0)
    ds.optimize.optimize_indices(index_names=[INDEX], num_indices_to_merge=newest)


def catch_up_bounded(ds: lance.LanceDataset) -> None:
    catch_up_indexes(ds, [INDEX], merge_rows=0)


POLICIES: dict[str, Callable[[lance.LanceDataset], None]] = {"old": catch_up_old, "bounded": catch_up_bounded}


def build(base: str, rows: int, catch_ups: int) -> dict[str, dict[str, Any]]:
    """Both tables, append by append; per policy the catch-ups' time and the segments seen."""
    delta = -(-rows // catch_ups)
    out: dict[str, dict[str, Any]] = {p: {"uri": os.path.join(base, f"{p}_{rows}.lance"), "catch_up_s": 0.0,
                                          "most_segments": 1} for p in POLICIES}
    for start in range(0, rows, delta):
        batch = rows_of(start, min(delta, rows - start))
        for policy, entry in out.items():
            first = start == 0
            ds = lance.write_dataset(batch, entry["uri"], mode="create" if first else "append",
                                     max_rows_per_file=FRAGMENT_ROWS)
            t0 = time.perf_counter()
            if first:
                ds.create_scalar_index("content_id", "BTREE", name=INDEX)
            else:
                POLICIES[policy](ds)
            entry["catch_up_s"] += time.perf_counter() - t0
            entry["most_segments"] = max(entry["most_segments"], len(segments(entry["uri"])))
    for entry in out.values():
        entry["segments"] = segments(entry["uri"])
        entry["catch_up_s"] = round(entry["catch_up_s"], 2)
    return out


def segments(uri: str) -> list[int]:
    """Rows per segment of the index, oldest first (read back from the table, not the policy)."""
    ds = lance.dataset(uri)
    rows = {f.fragment_id: f.metadata.num_rows for f in ds.get_fragments()}
    desc = next(d for d in ds.describe_indices() if d.name == INDEX)
    return [sum(rows.get(i, 0) for i in s.fragment_ids) for s in desc.segments]


def lookup(ds: lance.LanceDataset, rows: int, keys: Sequence[int]) -> tuple[int, float]:
    """Bytes read and seconds of one `IN` lookup; the rows must be exactly the ones written."""
    ids = content_ids_at(keys)
    ds.io_stats_incremental()
    t0 = time.perf_counter()
    found = ds.to_table(filter=keys_predicate("content_id", ids), columns=["n"])
    seconds = time.perf_counter() - t0
    read = ds.io_stats_incremental().read_bytes
    got = sorted(found["n"].to_pylist())  # row n holds the content id of position n: the keys' rows, no other
    if got != sorted(keys):
        raise AssertionError(f"lookup of {len(keys)} keys in {rows} rows found {len(got)} rows, not the ones written")
    return read, seconds


def measure(uri: str, rows: int, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """Cold (a fresh open) and warm (the same open table, other keys) lookups, medians of `repeats`."""
    rng = random.Random(seed)
    result: dict[str, dict[str, float]] = {}
    for name, n in LOOKUPS.items():
        samples: dict[str, list[tuple[int, float]]] = {"cold": [], "warm": []}
        for _ in range(repeats):
            ds = lance.dataset(uri)
            ds.io_stats_incremental()  # the open's manifest read is not the lookup's
            samples["cold"].append(lookup(ds, rows, rng.sample(range(rows), n)))
            samples["warm"].append(lookup(ds, rows, rng.sample(range(rows), n)))
        for phase, got in samples.items():
            result[f"{name}_{phase}"] = {"mb": round(statistics.median(b for b, _ in got) / 1e6, 3),
                                         "ms": round(statistics.median(s for _, s in got) * 1e3, 1)}
    return result


def run_size(base: str, rows: int, catch_ups: int, repeats: int) -> dict[str, Any]:
    print(f"{rows} rows in {catch_ups} appends, a catch-up after each ...", flush=True)
    tables = build(base, rows, catch_ups)
    size: dict[str, Any] = {"rows": rows, "catch_ups": catch_ups, "max_segments": MAX_SEGMENTS}
    for policy, entry in tables.items():
        size[policy] = {k: v for k, v in entry.items() if k != "uri"} | {
            "lookups": measure(entry["uri"], rows, repeats, seed=rows)}
        shutil.rmtree(entry["uri"], ignore_errors=True)
    size["ratios"] = {k: {m: round(size["old"]["lookups"][k][m] / max(size["bounded"]["lookups"][k][m], 1e-9), 2)
                          for m in ("mb", "ms")} for k in size["old"]["lookups"]}
    return size


def format_size(size: dict[str, Any]) -> str:
    lines = [f"{size['rows']:,} rows, {size['catch_ups']} catch-ups:",
             "| policy | segments (most) | catch-ups s | "
             + " | ".join(f"{k} {p} MB / ms" for p in ("cold", "warm") for k in LOOKUPS) + " |"]
    for policy in POLICIES:
        entry = size[policy]
        cells = [f"{entry['lookups'][f'{k}_{p}']['mb']} / {entry['lookups'][f'{k}_{p}']['ms']}"
                 for p in ("cold", "warm") for k in LOOKUPS]
        lines.append(f"| {policy} | {len(entry['segments'])} ({entry['most_segments']}) | {entry['catch_up_s']} | "
                     + " | ".join(cells) + " |")
    lines.append("old / bounded: " + ", ".join(f"{k} {r['mb']}x MB {r['ms']}x ms" for k, r in size["ratios"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1000000,4000000", help="comma-separated table sizes")
    parser.add_argument("--catch-ups", type=int, default=64, help="appends (each followed by a catch-up) per table")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dir", default=None, help="where the tables are built (removed afterwards)")
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="index_segments_", dir=args.dir)
    try:
        results = {"lance": lance.__version__, "cpus": os.cpu_count(), "sizes": []}
        for rows in (int(r) for r in args.rows.split(",")):
            size = run_size(base, rows, args.catch_ups, args.repeats)
            results["sizes"].append(size)
            print(format_size(size), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
