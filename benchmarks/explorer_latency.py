"""Explorer query latency over Lance: full-text search and nearest neighbours, before and after
compaction (issue 6).

For each table size, one in-process run:

1. write the synthetic captions table (`benchmarks.explorer_data`) the way the pipeline does, as
   many small commits (`--fragment-rows` rows each, like repeated partition writes);
2. build the indexes with `prx_core.store.maintenance.refresh_indexes` (INVERTED on `caption`,
   then IVF_PQ on `embedding` from 100k rows, IVF_FLAT below), timed;
3. time each query class (`benchmarks.explorer_queries`) one query at a time, after warm-ups, on
   one open dataset, and record from `explain_plan` whether it used the index, whether any part
   ran flat (unindexed fragments) and whether the filter used a scalar index; also recall@k
   against the exact neighbours and the hits of every planted word;
4. `prx_core.upkeep.compaction.compact_table`, then the same measurements again.

Last, outside `refresh_indexes`: a BITMAP index on `source`, and the two filtered classes again
(phase `bitmap`): what a scalar index on the explorer's filter columns would buy.

    python -m benchmarks.explorer_latency [--rows 100000,1000000] [--quick] [--json FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import lance

from benchmarks.explorer_data import PLANTED, K, make_workload, write_table
from benchmarks.explorer_queries import measure_phase, query_classes
from benchmarks.image_path import _cpu_name
from prx_core.store.lance_io import require_table
from prx_core.store.maintenance import fragment_health, refresh_indexes
from prx_core.upkeep.compaction import compact_table


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_size(rows: int, base_dir: str, *, fragment_rows: int, queries: int, warmups: int,
             nprobes: int, refine_factor: int, keep: bool) -> dict[str, Any]:
    """Write, index, measure, compact, measure again, add a BITMAP index, measure the filtered classes."""
    uri = os.path.join(base_dir, f"explorer_{rows}.lance")
    shutil.rmtree(uri, ignore_errors=True)
    work = make_workload(warmups + queries)
    result: dict[str, Any] = {"rows": rows, "fragment_rows": fragment_rows, "uri": uri,
                              "common_terms": work.common, "medium_terms": work.medium, "rare_planted": dict(PLANTED)}
    print(f"{rows} rows: writing {-(-rows // fragment_rows)} commits of {fragment_rows} rows ...", flush=True)
    t0 = time.perf_counter()
    write_table(uri, rows, fragment_rows, work)
    result["write_s"] = time.perf_counter() - t0
    health = fragment_health(uri)
    result["fragments_before"] = health.fragments
    result["table_rows"] = health.rows
    result["table_mb"] = _dir_mb(uri)
    print(f"  {health.fragments} fragments, {result['table_mb']:.0f} MB, written in {result['write_s']:.1f} s", flush=True)

    t0 = time.perf_counter()
    refresh_indexes(uri, ["caption"], None)
    result["fts_index_s"] = time.perf_counter() - t0
    print(f"  INVERTED index on caption: {result['fts_index_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    report = refresh_indexes(uri, [], "embedding")
    result["vector_index_s"] = time.perf_counter() - t0
    result["index_build_s"] = result["fts_index_s"] + result["vector_index_s"]
    ds = require_table(uri)
    vector = next(d for d in ds.describe_indices() if d.name == "embedding_vector")
    result["vector_index_type"] = vector.index_type
    result["indexes"] = report.indexes
    print(f"  {vector.index_type} index on embedding: {result['vector_index_s']:.1f} s", flush=True)
    result["peak_rss_mb_after_index"] = peak_rss_mb()

    classes = query_classes(work, nprobes, refine_factor)
    result.update(measure_phase(uri, classes, queries, warmups, work, "before"))

    t0 = time.perf_counter()
    compaction = compact_table(uri)
    result["compact_s"] = time.perf_counter() - t0
    result["fragments_after"] = fragment_health(uri).fragments
    print(f"  compact_table: {compaction.fragments_before} -> {compaction.fragments_after} fragments "
          f"in {result['compact_s']:.1f} s", flush=True)
    result.update(measure_phase(uri, classes, queries, warmups, work, "after"))

    # not part of refresh_indexes: what a scalar index on the filter column buys the filtered queries
    t0 = time.perf_counter()
    require_table(uri).create_scalar_index("source", "BITMAP", name="source_bitmap")
    result["bitmap_index_s"] = time.perf_counter() - t0
    filtered = [qc for qc in classes if "filter" in qc.make(0)]
    result.update(measure_phase(uri, filtered, queries, warmups, work, "bitmap"))
    result["peak_rss_mb"] = peak_rss_mb()
    if not keep:
        shutil.rmtree(uri, ignore_errors=True)
    return result


def _dir_mb(path: str) -> float:
    """Size on disk of a table's folder, in MB."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


CLASS_NAMES = ("fts_common", "fts_medium", "fts_rare", "fts_multi", "fts_filtered", "nn", "nn_filtered", "nn_norefine")


def format_table(results: dict[str, Any]) -> str:
    """The results as Markdown tables, one per table size, for docs/benchmarks.md."""
    lines = [f"explorer latency, {results['cpu']} ({results['cores']} cores), pylance {results['pylance']}, "
             f"limit/k {K}, nprobes {results['nprobes']}, refine_factor {results['refine_factor']}, "
             f"{results['queries']} queries after {results['warmups']} warm-ups", ""]
    for r in results["runs"]:
        lines += [
            f"{r['rows']:,} rows: {r['fragments_before']} -> {r['fragments_after']} fragments; write "
            f"{r['write_s']:.0f} s, index build {r['index_build_s']:.0f} s (INVERTED {r['fts_index_s']:.0f} s, "
            f"{r['vector_index_type']} {r['vector_index_s']:.0f} s), compaction {r['compact_s']:.0f} s; "
            f"planted hits {'OK' if r['rare_hits_ok_before'] and r['rare_hits_ok_after'] else 'WRONG'}; "
            f"peak RSS {r['peak_rss_mb']:.0f} MB",
            "",
            "| query | p50 ms before | p95 ms before | p50 ms after | p95 ms after | index before / after "
            "| p50 / p95 ms after + BITMAP(source) | hits | recall before / after |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in CLASS_NAMES:
            recall = (f"{r[f'{name}_recall_before']:.3f} / {r[f'{name}_recall_after']:.3f}"
                      if f"{name}_recall_before" in r else "")
            bitmap = (f"{r[f'{name}_p50_ms_bitmap']:.1f} / {r[f'{name}_p95_ms_bitmap']:.1f}"
                      if f"{name}_p50_ms_bitmap" in r else "")
            lines.append(
                f"| {name} | {r[f'{name}_p50_ms_before']:.1f} | {r[f'{name}_p95_ms_before']:.1f} | "
                f"{r[f'{name}_p50_ms_after']:.1f} | {r[f'{name}_p95_ms_after']:.1f} | "
                f"{r[f'{name}_index_before']} / {r[f'{name}_index_after']} | {bitmap} | "
                f"{r[f'{name}_hits_mean_after']:.1f} | {recall} |")
        lines.append("")
    return "\n".join(lines)


def run(rows: Sequence[int], base_dir: str, *, quick: bool = False, fragment_rows: int = 10_000,
        nprobes: int = 20, refine_factor: int = 10, keep: bool = False) -> dict[str, Any]:
    """Every table size in turn, with the machine and settings needed to compare runs."""
    queries, warmups = (20, 3) if quick else (50, 3)
    results: dict[str, Any] = {
        "benchmark": "explorer_latency", "cpu": _cpu_name(), "cores": os.cpu_count(),
        "pylance": lance.__version__, "queries": queries, "warmups": warmups, "k": K,
        "nprobes": nprobes, "refine_factor": refine_factor, "fragment_rows": fragment_rows, "runs": [],
    }
    for n in rows:
        results["runs"].append(run_size(n, base_dir, fragment_rows=fragment_rows, queries=queries, warmups=warmups,
                                        nprobes=nprobes, refine_factor=refine_factor, keep=keep))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The options of `prx-bench explorer`, also `python -m benchmarks.explorer_latency`."""
    parser = argparse.ArgumentParser(prog="prx-bench explorer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated table sizes (default 100000,1000000; 100000 with --quick)")
    parser.add_argument("--quick", action="store_true", help="20 timed queries per class instead of 50")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--dir", help="where to write the tables (kept); default: a temporary folder, removed")
    parser.add_argument("--fragment-rows", type=int, default=10_000, help="rows per append commit (default 10000)")
    parser.add_argument("--nprobes", type=int, default=20, help="IVF partitions searched (default 20)")
    parser.add_argument("--refine-factor", type=int, default=10, help="re-rank k*F PQ candidates exactly (default 10)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table, optionally write JSON; the table folder is kept only with --dir."""
    args = build_parser().parse_args(argv)
    rows = [int(x.replace("_", "")) for x in (args.rows or ("100000" if args.quick else "100000,1000000")).split(",")]
    started = time.time()
    tmp = None
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        base = args.dir
    else:
        base = tmp = tempfile.mkdtemp(prefix="explorer-bench-")
    try:
        results = run(rows, base, quick=args.quick, fragment_rows=args.fragment_rows, nprobes=args.nprobes,
                      refine_factor=args.refine_factor, keep=bool(args.dir))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    results["wall_seconds"] = time.time() - started
    print()
    print(format_table(results))
    print(f"{results['wall_seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
