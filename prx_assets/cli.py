"""The `prx-corpus` command line: doctor, demo-sources, build, browse, bench, bench-loader, bench-scale, bench-download.

Imports are lazy per command: `doctor` and `demo-sources` never load dagster or Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _cmd_doctor(args: argparse.Namespace) -> int:
    from prx_core.compute.doctor import FAIL, run_doctor

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


def _preflight_build(settings: object, catalog: object, sources: list[str] | None, select: list[str] | None) -> int:
    """`build`'s checks before Ray starts (prx_core.sources.preflight): the root is writable, each
    source's uri holds its format's files with the columns the catalog names (only when the run reads
    sources). Each problem on one line; returns how many."""
    from prx_core.sources.preflight import preflight
    from prx_core.store.storage import Storage

    storage = Storage(settings.root, settings.section("storage").get("storage_options") or {})
    specs = [catalog.get(name) for name in sources or catalog.names]
    problems = preflight(storage, specs, check_sources=not select or bool({"raw_source", "samples"} & set(select)))
    for problem in problems:
        where = f"{catalog.path}: " if problem.subject.startswith("source") else ""
        print(f"prx-corpus: error: {where}{problem.line()}", file=sys.stderr)
    if problems:
        print(f"prx-corpus: {len(problems)} problem(s) found before starting: nothing was run "
              "(--no-preflight skips these checks)", file=sys.stderr)
    return len(problems)


def _cmd_build(args: argparse.Namespace) -> int:
    import os

    from prx_assets.settings import load_settings, validate_request
    from prx_core.sources.catalog import load_catalog

    os.environ["PRX_ROOT"] = os.path.abspath(args.root) if "://" not in args.root else args.root
    os.environ["PRX_SOURCES"] = os.path.abspath(args.sources)
    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    os.environ.setdefault("LANCE_LOG", "error")  # not "No existing dataset, it will be created" per table
    started = time.time()
    settings = load_settings()
    catalog = load_catalog(settings.sources)
    select = [s.strip() for s in args.select.split(",") if s.strip()] if args.select else None
    validate_request(catalog.names, args.source, select)  # before the slow imports below
    if not args.no_preflight and _preflight_build(settings, catalog, args.source, select):
        return 2

    import ray

    from prx_assets.build import caption_lines, failure_lines, prepare_instance, run_build, sync_sources
    from prx_assets.definitions import build_definitions
    from prx_assets.stale import stale_plan
    from prx_core.compute.quiet import start_ray
    from prx_core.store.storage import Storage
    from prx_core.store.summary import corpus_summary, format_summary

    defs = build_definitions(settings)
    instance = prepare_instance(args.dagster_home, settings.root)
    print(f"corpus root {settings.root}\ncatalog {settings.sources} ({', '.join(catalog.names)})\n"
          f"dagster home {os.environ['DAGSTER_HOME']}", flush=True)
    sync_sources(instance, catalog)
    wanted = stale_plan(defs, instance, args.source or catalog.names, select) if args.stale else None
    if wanted == set():  # --stale, and Dagster reports nothing missing or unsynced: no Ray, no run
        return 0
    address = settings.section("ray").get("address")
    if address:  # the configured cluster, connected once for every materialization of the build
        print(f"ray cluster {address}", flush=True)
        start_ray(address)  # prx_core.compute.quiet: without the known third-party noise
    else:
        start_ray()
    try:
        outcome = run_build(defs, instance, catalog.names, args.source, select, wanted=wanted, verbose=args.verbose)
    finally:
        ray.shutdown()  # the embedded Ray's units in flight abort here: what is recorded stays recorded
    storage = defs.resources["storage"]
    if outcome.interrupted:  # the first Ctrl-C: no summary of a half-built corpus, just how to go on
        from prx_core.compute.interrupts import recorded_units

        for line in failure_lines(outcome):
            print(line)
        recorded = recorded_units(Storage(settings.root, dict(storage.storage_options)))
        print(f"\ninterrupted: rerun the same command to resume ({recorded} units recorded)", flush=True)
        return 130
    print("\n" + format_summary(corpus_summary(Storage(settings.root, dict(storage.storage_options)))))
    for line in caption_lines(outcome):
        print(line)
    for label in outcome.warnings:
        print(f"WARN check {label}")
    for label in outcome.failed_blocking:
        print(f"FAIL blocking check {label}")
    for line in failure_lines(outcome):  # each failed step's cause; tracebacks stay in the runs' Dagster logs
        print(line)
    for label in outcome.failed_runs:
        print(f"FAIL {label}")
    print(f"\n{outcome.runs} runs in {time.time() - started:.0f} s: " + ("ok" if outcome.ok else "FAILED"))
    return 0 if outcome.ok else 1


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

    try:
        app = create_app(storage, allowed_hosts=[args.host, *args.allow_host])
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
    from benchmarks.loader import format_table, run

    started = time.time()
    print(f"loader benchmark (one core): {args.samples} samples, CorpusDataset with and without 10% skipped ...",
          flush=True)
    results = run(samples=args.samples, repeats=args.repeats)
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
                  model_ms=args.model_ms)
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
    from prx_core.compute.doctor import default_root

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

    build = sub.add_parser("build", help="materialize the corpus through the Dagster definitions, print a summary")
    build.add_argument("--sources", required=True, help="the sources.yaml catalog")
    build.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    build.add_argument("--source", action="append", help="only this source (repeatable); default: all")
    build.add_argument("--select", help="comma-separated assets to materialize (default: all)")
    build.add_argument("--verbose", action="store_true", help="print the runs' whole Dagster log, tracebacks included "
                                                              "(by default each failure is one line in the summary)")
    build.add_argument("--no-preflight", action="store_true", help="skip the checks made before Ray starts (root "
                                                                   "writable; each source's uri, format and columns)")
    build.add_argument("--config", help="YAML with resource settings: storage, captioner, labeler, skip_policy, ray")
    build.add_argument("--dagster-home", help="Dagster instance folder (default: $DAGSTER_HOME, else the root's own: "
                                              "<root>/_state/dagster, or .prx/dagster/<digest> for s3://)")
    build.add_argument("--stale", action="store_true", help="materialize only what Dagster reports missing or "
                                                            "unsynced (and what depends on it), saying why")
    build.set_defaults(func=_cmd_build)
    from prx_assets import cli_sources  # `sources sync`: its own module
    cli_sources.add_parser(sub)

    browse = sub.add_parser("browse", help="read-only web explorer: caption search, neighbours, filters, plots")
    browse.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    browse.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    browse.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    browse.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host is NAME (repeatable; *.domain or *); localhost, "
                             "127.0.0.1, ::1 and --host always are: other Hosts get 400 (DNS rebinding)")
    browse.add_argument("--config", help="YAML whose storage.storage_options reach an object store")
    browse.set_defaults(func=_cmd_browse)

    bench = sub.add_parser("bench", help="image-path benchmark: naive vs process_image vs floor (one core)")
    bench.add_argument("--quick", action="store_true", help="200 images instead of 400 (under 3 minutes)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(func=_cmd_bench)

    bench_loader = sub.add_parser("bench-loader", help="training loader throughput, no skip-lists vs 10%% skipped (one core)")
    bench_loader.add_argument("--samples", type=int, default=4000, help="corpus size (default 4000)")
    bench_loader.add_argument("--repeats", type=int, default=5, help="alternated runs per loader (default 5)")
    bench_loader.add_argument("--json", metavar="FILE", help="also write the results as JSON")
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
    scale.add_argument("--workdir", help="where the corpora are built and kept (default: a temporary folder, removed "
                                         "size by size: 100,000 rows take ~5 GB)")
    scale.add_argument("--reuse-ray", action="store_true",
                       help="one Ray cluster for every stage (faster; by default a fresh one per stage)")
    scale.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    scale.set_defaults(func=_cmd_bench_scale)
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
    __import__("prx_assets.cli_ops", fromlist=["add_parser"]).add_parser(sub)  # opt-out, rewrite-stream
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
