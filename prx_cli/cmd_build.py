"""`prx-corpus build`: a preflight, then the corpus materialized through the Dagster definitions
(prx_cli.build), a per-source summary, and one line per failure. Exit 0 ok, 1 a failed run or
blocking check, 2 a bad request or a preflight problem, 130 interrupted (rerun to resume)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def add_parser(sub: Any) -> None:
    """Registers `build` on the `prx-corpus` subcommands (`sub`, from add_subparsers)."""
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
    build.add_argument("--rerun", help="comma-separated per-source assets to run again even where their inputs are as "
                                       "last committed (e.g. a reader fixed without a code version change)")
    build.set_defaults(func=_cmd_build)


def _rerun_problem(assets: list[str], select: list[str] | None) -> str | None:
    """Why `--rerun` cannot be honoured (checked before anything is created), or None."""
    from prx_core.stages.entry import STAGES

    per_source = [name for name, stage in STAGES.items() if stage.partition is None and stage.reusable]
    wrong = [a for a in assets if a not in per_source]
    unselected = [a for a in assets if select and a not in select]
    if wrong:
        return f"--rerun takes per-source assets that reuse their last commit ({', '.join(per_source)}), not {', '.join(wrong)}"
    return f"--rerun {', '.join(unselected)}: not among --select" if unselected else None


def _force_reruns(settings: Any, assets: list[str], sources: list[str]) -> None:
    """`--rerun`: each (asset, source)'s next run runs (prx_core.stages.unchanged.force_next_run)."""
    from prx_core.stages.unchanged import force_next_run
    from prx_core.store.storage import Storage

    store = Storage(settings.root, settings.section("storage").get("storage_options") or {})
    for asset in assets:
        forced = [source for source in sources if force_next_run(store, asset, source)]
        print(f"rerun {asset}: {', '.join(forced) or 'no source'} will run again"
              + (f" ({len(sources) - len(forced)} not committed yet)" if len(forced) < len(sources) else ""), flush=True)


def _preflight_build(settings: object, catalog: object, sources: list[str] | None, select: list[str] | None) -> int:
    """`build`'s checks before Ray starts (prx_core.sources.preflight): the root is writable, each
    source's uri holds its format's files with the columns the catalog names (only when the run reads
    sources). Each problem on one line; returns how many. Then, for each source that fetches, what
    its fetches may reach."""
    from prx_core.sources.catalog import DownloadSettings
    from prx_core.sources.fetch.policy import FetchPolicy
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
    for spec in specs if not problems else ():  # what a source that fetches may reach (prx_core.sources.fetch.policy)
        if spec.url_column or spec.download != DownloadSettings():
            print(f"source {spec.name!r}: {FetchPolicy(spec.download, spec.uri).describe()}", flush=True)
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
    rerun = [s.strip() for s in args.rerun.split(",") if s.strip()] if args.rerun else []
    if rerun and (problem := _rerun_problem(rerun, select)):
        print(f"prx-corpus: error: {problem}", file=sys.stderr)
        return 2
    if not args.no_preflight and _preflight_build(settings, catalog, args.source, select):
        return 2
    if rerun:
        _force_reruns(settings, rerun, args.source or catalog.names)

    import ray

    from prx_cli.build import caption_lines, failure_lines, prepare_instance, run_build, sync_sources
    from prx_assets.definitions import build_definitions
    from prx_cli.stale import stale_plan
    from prx_core.compute.quiet import start_ray
    from prx_core.store.storage import Storage
    from prx_core.ops.summary import corpus_summary, format_summary

    defs = build_definitions(settings)
    instance = prepare_instance(args.dagster_home, settings.root)
    print(f"corpus root {settings.root}\ncatalog {settings.sources} ({', '.join(catalog.names)})\n"
          f"dagster home {os.environ['DAGSTER_HOME']}", flush=True)
    sync_sources(instance, catalog)
    from prx_cli.build_progress import STATUS
    from prx_cli.build_report import REPORT_ENV, new_report_uri, save_build_report, warning_lines

    store = Storage(settings.root, settings.section("storage").get("storage_options") or {})
    report_uri = os.environ[REPORT_ENV] = new_report_uri(store)  # every run's tag, so its materializations link it
    wanted = stale_plan(defs, instance, args.source or catalog.names, select) if args.stale else None
    if wanted == set():  # --stale, and Dagster reports nothing missing or unsynced: no Ray, no run
        return 0
    # the configured cluster, connected once for every materialization of the build, else an embedded Ray
    # started with the configured ray_init_options
    ray_start = settings.ray_start()
    if "address" in ray_start:
        print(f"ray cluster {ray_start['address']}", flush=True)
    start_ray(**ray_start)  # prx_core.compute.quiet: without the known third-party noise
    try:
        outcome = run_build(defs, instance, catalog.names, args.source, select, wanted=wanted, verbose=args.verbose,
                            echo=STATUS.echo)  # above the live progress line, in a terminal
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
    summary = corpus_summary(Storage(settings.root, dict(storage.storage_options)))
    print("\n" + format_summary(summary))
    for line in caption_lines(outcome):
        print(line)
    for line in warning_lines(outcome.warnings):  # what each found; why and what to do, once per check
        print(line)
    for label in outcome.failed_blocking:
        print(f"FAIL blocking check {label}")
    for line in failure_lines(outcome):  # each failed step's cause; tracebacks stay in the runs' Dagster logs
        print(line)
    for label in outcome.failed_runs:
        print(f"FAIL {label}")
    try:
        save_build_report(report_uri, store, instance, outcome, summary, started, catalog, args.source or catalog.names,
                          defs.resources["explorer"].base_url)
        print(f"\nreport {report_uri}")
    except Exception as exc:  # the corpus is built either way: say so, and why the report is missing
        print(f"\nreport not written to {report_uri}: {type(exc).__name__}: {exc}")
    print(f"{outcome.runs} runs in {time.time() - started:.0f} s: " + ("ok" if outcome.ok else "FAILED"))
    return 0 if outcome.ok else 1
