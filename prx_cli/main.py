"""The `prx-corpus` command line: doctor, demo-sources, build, sources, plan, preview, eval-labels, browse,
opt-out, rewrite-stream, manifest, compact (the benchmarks are `prx-bench`, benchmarks.cli).

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


# The benchmarks' former subcommands: `prx-bench` runs them (benchmarks.cli); the product never imports benchmarks.
MOVED = {"bench": "image-path", "bench-loader": "loader", "bench-scale": "scale", "bench-dedup": "dedup",
         "bench-download": "download", "bench-explorer": "explorer"}


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

    from prx_cli import cmd_build, cmd_compact, cmd_labels, cmd_ops, cmd_plan, cmd_preview, cmd_sources  # a module per group

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

    cmd_ops.add_parser(sub)  # opt-out, rewrite-stream, manifest
    cmd_compact.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from prx_core.sources.catalog import CatalogError

    from prx_core.compute.interrupts import restore_interrupt_signals

    restore_interrupt_signals()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in MOVED:
        print(f"prx-corpus {argv[0]} is now `prx-bench {MOVED[argv[0]]}` (the benchmarks have their own entry point, "
              f"also `python -m benchmarks`)", file=sys.stderr)
        return 2
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
