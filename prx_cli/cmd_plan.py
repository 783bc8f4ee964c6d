"""`prx-corpus plan`: what a build of the catalog's sources will cost, before it starts.

Reads a sample of each source's images (no table is written, no Dagster run is made), measures
what the stages will do to them on this machine, and scales it by each source's size
(prx_core.stages.plan: sample, estimates): rows, MDS samples, streams and the small ones, bytes,
GPU-hours, core-hours, the wall time on this machine, the Ray cluster the settings name, or `--cpus`
and `--gpus` (it says which: prx_core.stages.plan.machine), and the cost when given prices.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_parser(sub: Any) -> None:
    """Registers `plan` on the `prx-corpus` subcommands (`sub`, from add_subparsers)."""
    plan = sub.add_parser("plan", help="estimate what building the sources will cost (rows, streams, bytes, GPU- "
                                       "and core-hours, wall time) from a sample of their images")
    plan.add_argument("--sources", required=True, help="the sources.yaml catalog")
    plan.add_argument("--source", action="append", default=[], help="only this source (repeatable)")
    plan.add_argument("--config", help="PRX_CONFIG settings (captioner, labeler, training batch, storage options)")
    plan.add_argument("--sample", type=int, default=1_000, help="images read per source (default 1000)")
    plan.add_argument("--cpus", type=int, help="cores for the wall time (default: this machine's, or the Ray "
                                               "cluster's when the settings give ray.address)")
    plan.add_argument("--gpus", type=int, help="GPUs for the wall time (default: this machine's, or the cluster's)")
    plan.add_argument("--gpu-hour-price", type=float, default=0.0, help="price of a GPU-hour: the backfill's cost")
    plan.add_argument("--cpu-hour-price", type=float, default=0.0, help="price of a core-hour")
    plan.add_argument("--gb-month-price", type=float, default=0.0, help="price of a GB stored for a month")
    plan.add_argument("--currency", default="$", help="printed before the prices (default $)")
    plan.add_argument("--caption-rate", type=float, default=None,
                      help="VLM captions per second per GPU (default 20, an H200's)")
    plan.add_argument("--retry-share", type=float, default=None,
                      help="share of VLM captions the caption checks refuse and generate again with the fallback "
                           "decoding (default 0.05; a captions run's fallbacks / eligible measures it)")
    plan.add_argument("--json", help="also write the plan as JSON to this file")
    plan.add_argument("--no-preflight", action="store_true", help="skip the checks `build` makes first (each "
                                                                  "source's uri, format and columns)")
    plan.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from prx_assets.settings import SettingsError, load_settings
    from prx_core.sources.catalog import load_catalog
    from prx_core.stages.plan.estimates import CAPTION_RATE, format_plan, plan_corpus
    from prx_core.stages.plan.machine import Prices, choose

    if args.sample < 1:
        raise SettingsError(f"--sample: must be at least 1, got {args.sample}")
    for name in ("cpus", "gpus", "gpu_hour_price", "cpu_hour_price", "gb_month_price"):
        if (getattr(args, name) or 0) < 0:
            raise SettingsError(f"--{name.replace('_', '-')}: must not be negative, got {getattr(args, name)}")
    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    settings = load_settings()
    catalog = load_catalog(os.path.abspath(args.sources))
    unknown = sorted(set(args.source) - set(catalog.names))
    if unknown:
        raise SettingsError(f"--source: {', '.join(unknown)} not in {args.sources} (sources: {', '.join(catalog.names)})")
    models = plan_models(settings, args.caption_rate or CAPTION_RATE)
    if args.retry_share is not None:
        if not 0 <= args.retry_share <= 1:
            raise SettingsError(f"--retry-share: must be from 0 to 1, got {args.retry_share}")
        models.retry_share = args.retry_share
    specs = [s for s in catalog.sources if not args.source or s.name in args.source]
    if not args.no_preflight and preflight_sources(catalog.path, specs, settings):
        return 2
    machine = choose(args.cpus, args.gpus, settings.section("ray").get("address"))
    print(f"sizing for {machine.describe()}", flush=True)
    prices = Prices(args.gpu_hour_price, args.cpu_hour_price, args.gb_month_price, args.currency)
    plan = plan_corpus(specs, models, args.sample, machine.cpus, machine.gpus,
                       settings.section("storage").get("storage_options") or {}, echo=lambda line: print(line, flush=True),
                       machine=machine.describe(), prices=prices if prices.given() else None)
    print(format_plan(plan))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(plan.to_json(), out, indent=1, default=str)
        print(f"plan written to {args.json}")
    return 0


def preflight_sources(catalog_path: str, specs: list[Any], settings: Any) -> int:
    """`build`'s source checks (prx_core.sources.preflight; no root: a plan writes nothing), each
    problem on one line as `build` prints it; returns how many."""
    import sys

    from prx_core.sources.preflight import check_source

    options = settings.section("storage").get("storage_options") or {}
    problems = [problem for spec in specs for problem in check_source(spec, options)]
    for problem in problems:
        print(f"prx-corpus: error: {catalog_path}: {problem.line()}", file=sys.stderr)
    if problems:
        print(f"prx-corpus: {len(problems)} problem(s) found before sampling: nothing was planned "
              "(--no-preflight skips these checks)", file=sys.stderr)
    return len(problems)


def plan_models(settings: Any, caption_rate: float) -> Any:
    """The models a build would run, from the settings' captioner, labeler and training sections."""
    from prx_assets.corpus_plan import models_of
    from prx_resources.models import CaptionerResource, LabelerResource
    from prx_resources.text_latents import TextLatentsResource
    from prx_resources.training import TrainingResource

    return models_of(CaptionerResource(**settings.section("captioner")), LabelerResource(**settings.section("labeler")),
                     TrainingResource(**settings.section("training")), TextLatentsResource(**settings.section("text_latents")),
                     caption_rate)
