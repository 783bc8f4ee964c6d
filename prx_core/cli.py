"""The `prx-corpus` command line: doctor, demo-sources, bench."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _cmd_doctor(args: argparse.Namespace) -> int:
    from prx_core.doctor import FAIL, run_doctor

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


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    from benchmarks.image_path import format_table, run

    started = time.time()
    print("image-path benchmark (one core): building the corpus, then naive / fused / floor ...", flush=True)
    results = run(quick=args.quick)
    results["wall_seconds"] = time.time() - started
    print(format_table(results))
    print(f"\n{results['wall_seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from prx_core.doctor import default_root

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

    bench = sub.add_parser("bench", help="image-path benchmark: naive vs process_image vs floor (one core)")
    bench.add_argument("--quick", action="store_true", help="200 images instead of 400 (under 3 minutes)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
