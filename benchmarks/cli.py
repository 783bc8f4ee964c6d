"""`prx-bench` (also `python -m benchmarks`): the performance suite's commands, results in docs/benchmarks.md.

Its own entry point, not subcommands of `prx-corpus`: the product (prx_cli and below) never imports
this package, so a deployed image runs without the benchmarks' synthetic corpora, peers and stand-ins
being part of what it loads. Imports are lazy per command, as in prx_cli.main.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _report(results: dict, table: str, started: float, json_path: str | None) -> int:
    """Print a benchmark's table and wall time; also write its results as JSON when asked."""
    import json

    results["wall_seconds"] = time.time() - started
    print(table)
    print(f"\n{results['wall_seconds']:.0f} s in all")
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"wrote {json_path}")
    return 0


def _cmd_image_path(args: argparse.Namespace) -> int:
    from benchmarks.image_path import format_table, run

    started = time.time()
    print("image-path benchmark (one core): building the corpus, then naive / fused / floor ...", flush=True)
    results = run(quick=args.quick)
    return _report(results, format_table(results), started, args.json)


def _cmd_loader(args: argparse.Namespace) -> int:
    import logging
    import os

    # streaming logs a notice per epoch when per_stream drops a stream's last incomplete batch, and
    # the resource tracker (a child process, hence the environment) warns at exit about every
    # shared-memory block streaming already unlinked: both are noise here.
    logging.getLogger("streaming.base.batching.per_stream").setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
    if args.scale:
        return _loader_scale(args)
    from benchmarks.loader import format_table, run

    started = time.time()
    print(f"loader benchmark (one core): {args.samples} samples, CorpusDataset with and without 10% skipped ...",
          flush=True)
    results = run(samples=args.samples, repeats=args.repeats)
    return _report(results, format_table(results), started, args.json)


def _loader_scale(args: argparse.Namespace) -> int:
    import os

    from benchmarks.loader_scale import format_table, run

    started = time.time()
    cache = args.cache or os.path.join(os.path.expanduser("~"), ".cache", "prx-bench", "loader-scale")
    print(f"loader at scale: a {args.scale:,}-sample tier, one node of {args.ranks} ranks x {args.workers} workers",
          flush=True)
    results = run(cache, samples=args.scale, streams=args.streams, shards=args.shards, ranks=args.ranks,
                  workers=args.workers, log=lambda line: print(line, flush=True))
    return _report(results, format_table(results), started, args.json)


def _cmd_scale(args: argparse.Namespace) -> int:
    import os

    from benchmarks.scale import format_table, run, select

    os.environ.setdefault("LANCE_LOG", "error")
    sizes = tuple(int(n) for n in args.rows.split(",") if n.strip())
    names = [name.strip() for name in args.resume.split(",")]
    resume = None if names == ["all"] else tuple(name for name in names if name and name != "none")
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip()) if args.stages else None
    try:
        select(stages, resume)
    except ValueError as exc:
        print(f"prx-bench scale: error: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    print(f"scale benchmark: the CPU graph (source captions) at {', '.join(map(str, sizes))} rows, then a resume "
          f"after SIGKILL ...", flush=True)
    results = run(sizes=sizes, unit_rows=args.unit_rows, cpus=args.cpus, cache=args.cache, workdir=args.workdir,
                  resume_rows=args.resume_rows, resume=resume, fresh_ray=not args.reuse_ray, stages=stages,
                  model_ms=args.model_ms, tiny=args.tiny, reference=args.reference_photos)
    return _report(results, format_table(results), started, args.json)


def _cmd_dedup(args: argparse.Namespace) -> int:
    import os

    from benchmarks.dedup import format_table, run

    os.environ.setdefault("LANCE_LOG", "error")
    started = time.time()
    print("dedup benchmark: the labelled photo set through samples, phashes and duplicates (both rules), "
          "and imagehash as the peer ...", flush=True)
    rules = tuple(r.strip() for r in args.rules.split(",") if r.strip())
    results = run(pictures=args.pictures, workdir=args.workdir, keep=args.keep, rules=rules)
    return _report(results, format_table(results), started, args.json)


def _cmd_download(args: argparse.Namespace) -> int:
    import os

    from benchmarks.download import format_table, run

    os.environ.setdefault("LANCE_LOG", "error")
    started = time.time()
    print(f"download benchmark: {args.images} images fetched from a loopback server vs read from parquet, "
          f"through the samples stage ...", flush=True)
    results = run(images=args.images, files=args.files, cpus=args.cpus, workdir=args.workdir)
    return _report(results, format_table(results), started, args.json)


def _cmd_content_ranges(args: argparse.Namespace) -> int:
    from benchmarks.content_ranges import format_size, main

    started = time.time()
    results = main(["--rows", args.rows, "--sources", str(args.sources), "--units", str(args.units), "--keys", args.keys]
                   + (["--dir", args.dir] if args.dir else []))
    return _report(results, "\n".join(format_size(s) for s in results["sizes"]), started, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prx-bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("image-path", help="image-path benchmark: naive vs process_image vs floor (one core)")
    bench.add_argument("--quick", action="store_true", help="200 images instead of 400 (under 3 minutes)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(func=_cmd_image_path)

    bench_loader = sub.add_parser("loader", help="training loader throughput, no skip-lists vs 10%% skipped (one core)")
    bench_loader.add_argument("--samples", type=int, default=4000, help="corpus size (default 4000)")
    bench_loader.add_argument("--repeats", type=int, default=5, help="alternated runs per loader (default 5)")
    bench_loader.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench_loader.add_argument("--scale", type=int, metavar="SAMPLES",
                              help="instead: the loader's memory and start-up per node on a synthetic tier of this "
                                   "many samples (1000000000 for PRX scale; generated once under --cache)")
    bench_loader.add_argument("--streams", type=int, default=4000, help="--scale: streams in the tier (default 4000)")
    bench_loader.add_argument("--shards", type=int, default=1_400_000, help="--scale: shards (default 1400000)")
    bench_loader.add_argument("--ranks", type=int, default=8, help="--scale: ranks of the node (default 8)")
    bench_loader.add_argument("--workers", type=int, default=8, help="--scale: dataloader workers per rank (default 8)")
    bench_loader.add_argument("--cache", help="--scale: where the synthetic tier is kept (default ~/.cache/prx-bench)")
    bench_loader.set_defaults(func=_cmd_loader)
    scale = sub.add_parser("scale", help="the CPU graph at 10k and 100k rows: rows/s, peak RSS, Lance versions; "
                                               "resume after SIGKILL")
    scale.add_argument("--rows", default="10000,100000", help="comma-separated sizes (default 10000,100000)")
    scale.add_argument("--unit-rows", type=int, default=5000,
                       help="rows per work unit at every size (default 5000; source files and MDS chunks of half)")
    scale.add_argument("--cpus", type=int, help="CPUs of the benchmark's Ray (default: all cores)")
    scale.add_argument("--resume", default="all",
                       help="stages given a SIGKILL resume trial: all (the work-unit stages), none, or a comma list")
    scale.add_argument("--stages", help="only these stages, in graph order (default: all; each needs the ones it reads)")
    scale.add_argument("--resume-rows", type=int, help="size of the resume trials (default: the largest)")
    scale.add_argument("--model-ms", type=float, default=2.0,
                       help="cost per image or caption of the stand-in captioner, labeller and embedder (default 2 ms)")
    scale.add_argument("--cache", help="synthetic photos cache (default $XDG_CACHE_HOME/prx-bench-scale)")
    scale.add_argument("--reference-photos", type=int, default=300,
                       help="photos each process_image pass times (default 300, ~1 s a pass; 9 passes a size)")
    scale.add_argument("--tiny", action="store_true",
                       help="448x336 photos of ~7 KB (renders ~20 KB) instead of 640x480 of ~39 KB: a 1M-row run in ~50 GB")
    scale.add_argument("--workdir", help="where the corpora are built and kept (default: a temporary folder, removed "
                                         "size by size: 100,000 rows take ~5 GB)")
    scale.add_argument("--reuse-ray", action="store_true",
                       help="one Ray cluster for every stage (faster; by default a fresh one per stage)")
    scale.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    scale.set_defaults(func=_cmd_scale)
    bench_dedup = sub.add_parser("dedup", help="deduplication through the pipeline on labelled real photos: "
                                                     "recall per kind of copy, merges of different pictures, keepers; "
                                                     "imagehash as the peer")
    bench_dedup.add_argument("--pictures", type=int, help="use only the first N pictures (default: all, ~130)")
    bench_dedup.add_argument("--workdir", help="write the set and corpora here and keep them (default: a temp folder)")
    bench_dedup.add_argument("--keep", action="store_true", help="keep the temporary folder")
    bench_dedup.add_argument("--rules", default="keys,phash", help="duplicates rules to build with (default: keys,phash)")
    bench_dedup.add_argument("--json", help="also write the results as JSON to this file")
    bench_dedup.set_defaults(func=_cmd_dedup)
    bench_download = sub.add_parser("download", help="samples stage images/s: a URL table fetched from a "
                                                           "loopback server vs the same bytes in parquet")
    bench_download.add_argument("--images", type=int, default=6000, help="rows of each source (default 6000)")
    bench_download.add_argument("--files", type=int, default=12, help="parquet files (work units) of each (default 12)")
    bench_download.add_argument("--cpus", type=int, help="CPUs of the benchmark's Ray (default: up to 4 cores)")
    bench_download.add_argument("--workdir", help="where the sources and corpora are kept (default: a temporary folder)")
    bench_download.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench_download.set_defaults(func=_cmd_download)
    ranges = sub.add_parser("content-ranges", help="bytes a content unit's key lookup reads from a shared table of "
                                                  "1M-16M rows: random keys (old units) vs a content range (new)")
    ranges.add_argument("--rows", default="1000000,4000000", help="comma-separated table sizes (default 1M,4M)")
    ranges.add_argument("--sources", type=int, default=10, help="sources sharing the table (default 10)")
    ranges.add_argument("--units", type=int, default=4, help="units measured per pattern and size (default 4)")
    ranges.add_argument("--keys", choices=("content", "caption"), default="content",
                        help="the table's key: content ids (model captioners, default) or the source captioner's caption keys")
    ranges.add_argument("--dir", help="where the tables are built (removed afterwards)")
    ranges.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ranges.set_defaults(func=_cmd_content_ranges)
    # Its own parser (benchmarks.explorer_latency) takes the arguments: see main().
    sub.add_parser("explorer", add_help=False,
                   help="explorer query latency, FTS and nearest neighbours over 100k and 1M rows (--help for options)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["explorer"]:
        from benchmarks.explorer_latency import main as bench_explorer

        return bench_explorer(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `prx-bench` console script: `main`, then an exit without interpreter finalization
    (prx_core.compute.exits: Arrow threads still finishing at exit aborted finished runs)."""
    from prx_core.compute.exits import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
