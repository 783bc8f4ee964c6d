"""The `prx-corpus` command line: doctor, demo-sources, build, sources, browse, opt-out, rewrite-stream and the benchmarks.

Imports are lazy per command: `doctor` and `demo-sources` never load dagster or Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _cmd_doctor(args: argparse.Namespace) -> int:
    from prx_core.ops.doctor import FAIL, run_doctor

    checks = run_doctor(args.root, with_ray=not args.no_ray)
    for check in checks:
        print(check.line(), flush=True)
    failed = [c for c in checks if c.status == FAIL]
    print(f"\n{len(checks)} checks: {len(failed)} FAIL, {sum(c.status == 'WARN' for c in checks)} WARN")
    return 1 if failed else 0


def _cmd_demo_sources(args: argparse.Namespace) -> int:
    from prx_core.demo import build_demo_sources

    started = time.time()
    print(f"writing demo sources to {args.dir} ...", flush=True)
    manifest = build_demo_sources(args.dir, use_wallpapers=not args.no_wallpapers)
    print(f"{len(manifest.samples)} samples in {time.time() - started:.1f} s")
    for source, count in sorted(manifest.by_source().items()):
        print(f"  {source:<14} {count:>4} samples")
    planted = ", ".join(f"{k} {v}" for k, v in sorted(manifest.kinds().items()) if k != "photo")
    print(f"planted: {planted}")
    print(f"catalog: {manifest.root}/sources.yaml   manifest: {manifest.root}/manifest.json")
    return 0


def _cmd_browse(args: argparse.Namespace) -> int:
    import ipaddress
    import os

    from prx_assets.settings import SettingsError, load_settings
    from prx_core.store import lance_io
    from prx_core.store.storage import Storage

    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    storage = Storage(args.root, load_settings().section("storage").get("storage_options") or {})
    if not lance_io.table_exists(storage.lance_uri("samples"), storage.lance_storage_options()):
        raise SettingsError(f"no corpus at {storage.root}: its samples table does not exist (run prx-corpus build first)")
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        print(f"warning: serving on {args.host}, reachable from the network (read-only, no authentication)",
              file=sys.stderr)

    import uvicorn

    from prx_explorer.app import create_app
    from prx_explorer.disk_cache import DiskThumbnails

    thumbnails = DiskThumbnails(args.thumb_cache, args.thumb_cache_mb << 20) if args.thumb_cache_mb > 0 else None
    try:
        app = create_app(storage, allowed_hosts=[args.host, *args.allow_host], thumbnails=thumbnails)
    except ValueError as exc:  # a malformed --allow-host
        raise SettingsError(f"--allow-host: {exc}") from exc
    print(f"explorer for {storage.root} on http://{args.host}:{args.port}/", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


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


def _cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.image_path import format_table, run

    started = time.time()
    print("image-path benchmark (one core): building the corpus, then naive / fused / floor ...", flush=True)
    results = run(quick=args.quick)
    return _report(results, format_table(results), started, args.json)


def _cmd_bench_loader(args: argparse.Namespace) -> int:
    import logging
    import os

    # streaming logs a notice per epoch when per_stream drops a stream's last incomplete batch, and
    # the resource tracker (a child process, hence the environment) warns at exit about every
    # shared-memory block streaming already unlinked: both are noise here.
    logging.getLogger("streaming.base.batching.per_stream").setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
    if args.scale:
        return _bench_loader_scale(args)
    from benchmarks.loader import format_table, run

    started = time.time()
    print(f"loader benchmark (one core): {args.samples} samples, CorpusDataset with and without 10% skipped ...",
          flush=True)
    results = run(samples=args.samples, repeats=args.repeats)
    return _report(results, format_table(results), started, args.json)


def _bench_loader_scale(args: argparse.Namespace) -> int:
    import os

    from benchmarks.loader_scale import format_table, run

    started = time.time()
    cache = args.cache or os.path.join(os.path.expanduser("~"), ".cache", "prx-bench", "loader-scale")
    print(f"loader at scale: a {args.scale:,}-sample tier, one node of {args.ranks} ranks x {args.workers} workers",
          flush=True)
    results = run(cache, samples=args.scale, streams=args.streams, shards=args.shards, ranks=args.ranks,
                  workers=args.workers, log=lambda line: print(line, flush=True))
    return _report(results, format_table(results), started, args.json)


def _cmd_bench_scale(args: argparse.Namespace) -> int:
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
        print(f"prx-corpus bench-scale: error: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    print(f"scale benchmark: the CPU graph (source captions) at {', '.join(map(str, sizes))} rows, then a resume "
          f"after SIGKILL ...", flush=True)
    results = run(sizes=sizes, unit_rows=args.unit_rows, cpus=args.cpus, cache=args.cache, workdir=args.workdir,
                  resume_rows=args.resume_rows, resume=resume, fresh_ray=not args.reuse_ray, stages=stages,
                  model_ms=args.model_ms, tiny=args.tiny)
    return _report(results, format_table(results), started, args.json)


def _cmd_bench_dedup(args: argparse.Namespace) -> int:
    import os

    from benchmarks.dedup import format_table, run

    os.environ.setdefault("LANCE_LOG", "error")
    started = time.time()
    print("dedup benchmark: the labelled photo set through samples, phashes and duplicates (both rules), "
          "and imagehash as the peer ...", flush=True)
    rules = tuple(r.strip() for r in args.rules.split(",") if r.strip())
    results = run(pictures=args.pictures, workdir=args.workdir, keep=args.keep, rules=rules)
    return _report(results, format_table(results), started, args.json)


def _cmd_bench_download(args: argparse.Namespace) -> int:
    import os

    from benchmarks.download import format_table, run

    os.environ.setdefault("LANCE_LOG", "error")
    started = time.time()
    print(f"download benchmark: {args.images} images fetched from a loopback server vs read from parquet, "
          f"through the samples stage ...", flush=True)
    results = run(images=args.images, files=args.files, cpus=args.cpus, workdir=args.workdir)
    return _report(results, format_table(results), started, args.json)


def build_parser() -> argparse.ArgumentParser:
    from prx_core.ops.doctor import default_root

    parser = argparse.ArgumentParser(prog="prx-corpus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check versions, pillow-simd/AVX2, codecs, Ray, vLLM and storage")
    doctor.add_argument("--root", default=default_root(), help="corpus root URI to probe (default: $PRX_ROOT or ./.prx/corpus)")
    doctor.add_argument("--no-ray", action="store_true", help="skip starting an embedded Ray")
    doctor.set_defaults(func=_cmd_doctor)

    demo = sub.add_parser("demo-sources", help="write the demo sources and their sources.yaml catalog")
    demo.add_argument("dir", help="output folder (replaced whole)")
    demo.add_argument("--no-wallpapers", action="store_true", help="use only scikit-image's photos")
    demo.set_defaults(func=_cmd_demo_sources)

    from prx_cli import cmd_build, cmd_labels, cmd_ops, cmd_plan, cmd_preview, cmd_sources  # a module per group

    cmd_build.add_parser(sub)
    cmd_sources.add_parser(sub)
    cmd_plan.add_parser(sub)
    cmd_preview.add_parser(sub)
    cmd_labels.add_parser(sub)

    browse = sub.add_parser("browse", help="read-only web explorer: caption search, neighbours, filters, plots")
    browse.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    browse.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    browse.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    browse.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host is NAME (repeatable; *.domain or *); localhost, "
                             "127.0.0.1, ::1 and --host always are: other Hosts get 400 (DNS rebinding)")
    browse.add_argument("--config", help="YAML whose storage.storage_options reach an object store")
    browse.add_argument("--thumb-cache", default=str(Path.home() / ".cache" / "prx-corpus" / "thumbnails"), metavar="DIR",
                        help="rendered thumbnails kept here across restarts, keyed by image content (shareable "
                             "between roots; default ~/.cache/prx-corpus/thumbnails)")
    browse.add_argument("--thumb-cache-mb", type=int, default=1024, metavar="MB",
                        help="bound of that folder; least recently used thumbnails go first (default 1024; 0: no disk cache)")
    browse.set_defaults(func=_cmd_browse)

    bench = sub.add_parser("bench", help="image-path benchmark: naive vs process_image vs floor (one core)")
    bench.add_argument("--quick", action="store_true", help="200 images instead of 400 (under 3 minutes)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(func=_cmd_bench)

    bench_loader = sub.add_parser("bench-loader", help="training loader throughput, no skip-lists vs 10%% skipped (one core)")
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
    bench_loader.set_defaults(func=_cmd_bench_loader)
    scale = sub.add_parser("bench-scale", help="the CPU graph at 10k and 100k rows: rows/s, peak RSS, Lance versions; "
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
    scale.add_argument("--tiny", action="store_true",
                       help="448x336 photos of ~7 KB (renders ~20 KB) instead of 640x480 of ~39 KB: a 1M-row run in ~50 GB")
    scale.add_argument("--workdir", help="where the corpora are built and kept (default: a temporary folder, removed "
                                         "size by size: 100,000 rows take ~5 GB)")
    scale.add_argument("--reuse-ray", action="store_true",
                       help="one Ray cluster for every stage (faster; by default a fresh one per stage)")
    scale.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    scale.set_defaults(func=_cmd_bench_scale)
    bench_dedup = sub.add_parser("bench-dedup", help="deduplication through the pipeline on labelled real photos: "
                                                     "recall per kind of copy, merges of different pictures, keepers; "
                                                     "imagehash as the peer")
    bench_dedup.add_argument("--pictures", type=int, help="use only the first N pictures (default: all, ~130)")
    bench_dedup.add_argument("--workdir", help="write the set and corpora here and keep them (default: a temp folder)")
    bench_dedup.add_argument("--keep", action="store_true", help="keep the temporary folder")
    bench_dedup.add_argument("--rules", default="keys,phash", help="duplicates rules to build with (default: keys,phash)")
    bench_dedup.add_argument("--json", help="also write the results as JSON to this file")
    bench_dedup.set_defaults(func=_cmd_bench_dedup)
    bench_download = sub.add_parser("bench-download", help="samples stage images/s: a URL table fetched from a "
                                                           "loopback server vs the same bytes in parquet")
    bench_download.add_argument("--images", type=int, default=6000, help="rows of each source (default 6000)")
    bench_download.add_argument("--files", type=int, default=12, help="parquet files (work units) of each (default 12)")
    bench_download.add_argument("--cpus", type=int, help="CPUs of the benchmark's Ray (default: up to 4 cores)")
    bench_download.add_argument("--workdir", help="where the sources and corpora are kept (default: a temporary folder)")
    bench_download.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench_download.set_defaults(func=_cmd_bench_download)
    # Its own parser (benchmarks.explorer_latency) takes the arguments: see main().
    sub.add_parser("bench-explorer", add_help=False,
                   help="explorer query latency, FTS and nearest neighbours over 100k and 1M rows (--help for options)")
    cmd_ops.add_parser(sub)  # opt-out, rewrite-stream, manifest
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from prx_core.sources.catalog import CatalogError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench-explorer"]:
        from benchmarks.explorer_latency import main as bench_explorer

        return bench_explorer(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CatalogError as exc:  # and its SettingsError: --source, --select, --config
        print(f"prx-corpus: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `prx-corpus` console script: `main`, then an exit without interpreter finalization
    (prx_core.compute.exits: Arrow threads still finishing at exit aborted finished builds)."""
    from prx_core.compute.exits import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
