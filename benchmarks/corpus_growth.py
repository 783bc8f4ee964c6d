"""What one work unit of each stage reads while the rest of the corpus grows (issue 41, done-when).

A unit's cost must not grow with the corpus: a stage that looks up random keys per unit in a
shared table reads more index pages per unit as the table grows; one that reads its own range
does not. Measured through the stages themselves, not a model of their lookups:

1. one source of `--rows` synthetic photos (benchmarks.scale, tiny) is built through `samples`,
   `buckets`, `phashes`, `captions` (source captions), `caption_labels` (a stand-in labeller),
   `duplicates`, `mds_shards` and `skip_lists`, each stage's driver in its own process;
2. per corpus size C, the shared tables get C rows of ten other sources (`pad_table`: the source's
   own rows over and over with new sample ids, content ids and caption keys, images and
   fingerprints left empty; the measured stages never read another source's bytes), indexed as the
   stages index them (BTREE and BITMAP; the full-text indexes, which no unit reads, are left out);
3. each measured stage's last run of the source is not reused (`force_next_run`) and the stage
   runs again: every unit runs, and records the bytes it read (`read_bytes`, the
   worker's `rchar`, prx_core.compute.units.process_read_bytes). Stages whose outputs are all
   stored (captions, labels) still run each unit's lookups, which is what is measured.

Per stage and phase: the median and largest bytes read per unit and the median seconds per unit,
at every size; the growth is the largest size's median over the smallest's (the target: within
1.2x from 1M to 16M). Model units run two at a time on an actor (UNITS_PER_ACTOR): there a unit's
bytes include its neighbour's.

    python -m benchmarks.corpus_growth [--rows 20000] [--unit-rows 5000] [--corpus 1000000,4000000,16000000]
                                       [--stages buckets,...] [--cache DIR] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks.index_segments import content_ids_at

BUILD = ("samples", "buckets", "phashes", "captions", "caption_labels", "duplicates", "mds_shards", "skip_lists")
MEASURED = ("buckets", "phashes", "captions", "caption_labels", "mds_shards", "skip_lists")
PADDED = ("samples", "buckets", "phashes", "captions", "caption_labels", "duplicates", "mds_index")
OTHERS = 10  # the other sources the padding rows belong to
WRITE_ROWS = 500_000
FRAGMENT_ROWS = 1_000_000  # the shared tables' fragments after compaction (upkeep.appends.MERGE_ROWS)
EMPTIED = ("image", "embedding", "match_keys", "signature", "metadata")  # bytes no measured unit reads of others
KEY_COLUMNS = ("content_id", "image_content_id", "group_id", "component_id")


def filler_rows(template: pa.Table, start: int, n: int) -> pa.Table:
    """Rows start..start+n of the other sources: `template`'s rows over and over with new keys. A
    key keeps its template's length (a caption key is a content id and a hash: the new content id,
    then the template's hash), so it sorts among the real ones as a real one would."""
    positions = np.arange(start, start + n)
    rows = template.take(pa.array(positions % template.num_rows))
    ids = content_ids_at(positions.tolist())
    sources = [f"other{p % OTHERS:02d}" for p in positions.tolist()]
    columns = {}
    for field in rows.schema:
        old = rows[field.name]
        if field.name == "source":
            new = pa.array(sources, field.type)
        elif field.name in ("sample_id", "keeper_sample_id"):
            new = pa.array([f"{s}/k{p:010d}" for s, p in zip(sources, positions.tolist())], field.type)
        elif field.name in KEY_COLUMNS:
            new = pa.array([None if v is None else (i + v[64:])[:len(v)] for i, v in zip(ids, old.to_pylist())],
                           field.type)
        elif field.name in EMPTIED:
            new = pa.nulls(n, field.type)
        else:
            new = old
        columns[field.name] = new
    return pa.table(columns, schema=template.schema)


def template_rows(ds: Any, source: str) -> pa.Table:
    """The rows padding copies: the measured source's (a per-source table) or all (a content-keyed
    one, which holds only the source's contents yet); one made-up row where the table is empty
    (no duplicates among distinct photos)."""
    from prx_core.store.partitions import source_predicate

    columns = [f.name for f in ds.schema if f.name not in EMPTIED]
    table = ds.to_table(columns=columns, filter=source_predicate(source) if "source" in ds.schema.names else None)
    for name in EMPTIED:
        if name in ds.schema.names:
            table = table.append_column(ds.schema.field(name), pa.nulls(table.num_rows, ds.schema.field(name).type))
    table = table.select(ds.schema.names)
    if table.num_rows:
        return table
    made = {f.name: [made_value(f.type, f.name, source)] for f in ds.schema}
    return pa.table(made, schema=ds.schema)


def made_value(kind: pa.DataType, name: str, source: str) -> Any:
    if name in EMPTIED:
        return None
    if pa.types.is_string(kind):
        return source if name == "source" else f"{source}/made" if name.endswith("sample_id") else "0" * 64
    if pa.types.is_boolean(kind):
        return False
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return 0
    return None


def pad_table(uri: str, table: str, source: str, have: int, want: int) -> float:
    """Append rows `have`..`want` of the other sources to `table` and catch its key indexes up (the
    BTREE and BITMAP indexes the stages keep); seconds taken."""
    import lance

    from prx_core.store.maintenance import refresh_indexes
    from prx_core.store.schemas import BTREE_COLUMNS, FILTER_COLUMNS, PARTITION_COLUMNS

    began = time.monotonic()
    template = template_rows(lance.dataset(uri), source)
    for start in range(have, want, WRITE_ROWS):
        rows = filler_rows(template, start, min(WRITE_ROWS, want - start))
        lance.write_dataset(rows, uri, mode="append", max_rows_per_file=FRAGMENT_ROWS)
    refresh_indexes(uri, bitmap_columns=[*PARTITION_COLUMNS.get(table, ()), *FILTER_COLUMNS.get(table, ())],
                    btree_columns=BTREE_COLUMNS.get(table, ()))
    return time.monotonic() - began


def unit_reads(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per phase of a driver's result: units, median and largest MB read per unit, median seconds."""
    phases = {}
    for phase, units in result["units"].items():
        reads = [r / 1e6 for r in units.get("unit_read_bytes", [])]
        seconds = units.get("unit_seconds", [])
        if reads:
            phases[phase] = {"units": len(reads), "read_mb": round(statistics.median(reads), 3),
                             "read_mb_max": round(max(reads), 3),
                             "seconds": round(statistics.median(seconds), 3) if seconds else None}
    return phases


def growth(sizes: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per `stage/phase`: the largest corpus's median MB per unit over the smallest's."""
    first, last = sizes[0]["stages"], sizes[-1]["stages"]
    out = {}
    for stage, phases in last.items():
        for phase, numbers in phases.items():
            before = first.get(stage, {}).get(phase, {}).get("read_mb")
            out[f"{stage}/{phase}"] = round(numbers["read_mb"] / before, 2) if before else None
    return out


def run(rows: int, unit_rows: int, corpus: Sequence[int], stages: Sequence[str], cache: str | None,
        workdir: str | None, cpus: int) -> dict[str, Any]:
    from benchmarks.scale import default_cache, synthetic_source, unit_sizes
    from benchmarks.scale_driver import Cluster, run_driver
    from prx_core.stages.unchanged import force_next_run
    from prx_core.store.storage import Storage

    source_dir = synthetic_source(Path(cache) if cache else default_cache(), rows, max(1, unit_rows // 2), cpus, True)
    spec = {"name": "bench", "format": "parquet", "uri": str(source_dir), "image_column": "image",
            "caption_column": "caption", "key_column": "key"}
    work = Path(workdir or tempfile.mkdtemp(prefix="prx-bench-growth-"))
    job = {"root": str(work / "corpus"), "source": spec, "units": unit_sizes(unit_rows, source_dir), "cpus": cpus,
           "model_seconds": 0.0}
    storage, cluster = Storage(job["root"]), Cluster(cpus, fresh=False)
    results: dict[str, Any] = {"rows": rows, "unit_rows": unit_rows, "cpus": cpus, "sizes": []}
    try:
        with cluster.session() as address:
            print(f"building source `bench` of {rows} rows: {', '.join(BUILD)}", flush=True)
            for stage in BUILD:
                run_driver({**job, "stage": stage, "address": address})
            have = 0
            for size in sorted(corpus):
                padding = {}
                for table in PADDED:
                    padding[table] = round(pad_table(storage.lance_uri(table), table, "bench", have, size), 1)
                have = size
                print(f"corpus of {size} other rows (padded in {sum(padding.values()):.0f} s)", flush=True)
                measured = {}
                for stage in stages:
                    force_next_run(storage, stage, "bench")  # its units run again, their lookups measured
                    measured[stage] = unit_reads(run_driver({**job, "stage": stage, "address": address}))
                    for phase, numbers in measured[stage].items():
                        print(f"  {stage:<15} {phase:<8} {numbers['units']:>3} units  {numbers['read_mb']:8.2f} MB/unit "
                              f"(max {numbers['read_mb_max']:.2f})  {numbers['seconds']} s/unit", flush=True)
                results["sizes"].append({"corpus_rows": size, "padding_s": padding, "stages": measured})
    finally:
        cluster.close()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["growth"] = growth(results["sizes"]) if results["sizes"] else {}
    return results


def format_table(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    head = "| stage / phase | " + " | ".join(f"{s['corpus_rows']:,} rows: MB / s per unit" for s in sizes) + " | growth |"
    lines = [head, "|" + "---|" * (len(sizes) + 2)]
    for key, ratio in results["growth"].items():
        stage, phase = key.split("/")
        cells = []
        for size in sizes:
            n = size["stages"].get(stage, {}).get(phase)
            cells.append(f"{n['read_mb']:.2f} / {n['seconds']}" if n else "-")
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {ratio}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the measured source")
    parser.add_argument("--unit-rows", type=int, default=5_000)
    parser.add_argument("--corpus", default="1000000,4000000,16000000", help="rows of the other sources, in turn")
    parser.add_argument("--stages", default=",".join(MEASURED))
    parser.add_argument("--cache", help="the synthetic photos' cache (benchmarks.scale's by default)")
    parser.add_argument("--dir", help="keep the corpus here (default: a temporary folder, deleted)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if unknown := sorted(set(stages) - set(MEASURED)):
        parser.error(f"unknown stage {', '.join(unknown)} (measured: {', '.join(MEASURED)})")
    os.environ.setdefault("LANCE_LOG", "error")
    started = time.time()
    results = run(args.rows, args.unit_rows, [int(n) for n in args.corpus.split(",")], stages, args.cache, args.dir,
                  os.cpu_count() or 1)
    results["wall_seconds"] = round(time.time() - started)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
