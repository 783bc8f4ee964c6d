"""`prx-corpus sources sync`: the catalog's names as the `sources` partitions of a Dagster instance.

Dagster's own CLI and UI launch a partition only once the instance knows it: on a fresh instance
`dagster asset materialize -m prx_assets.definitions --select samples --partition photos` fails
with "Could not find a partition with key `photos`" until the sources sensor has run (that needs
the daemon) or this command has. `prx-corpus build` runs the same sync first.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_parser(sub: Any) -> None:
    """Registers `sources sync` on the `prx-corpus` subcommands (`sub`, from add_subparsers)."""
    sources = sub.add_parser("sources", help="the catalog's sources as the Dagster instance's partitions")
    actions = sources.add_subparsers(dest="action", required=True)
    sync = actions.add_parser("sync", help="register the catalog's names as the `sources` partitions (removing "
                                           "those it no longer lists), for Dagster's CLI and UI on a fresh instance")
    sync.add_argument("--sources", required=True, help="the sources.yaml catalog")
    sync.add_argument("--root", help="corpus root whose Dagster home to use (default: $PRX_ROOT, else the demo's)")
    sync.add_argument("--dagster-home", help="Dagster instance folder (default: $DAGSTER_HOME, else the root's own)")
    sync.add_argument("--config", help="the PRX_CONFIG settings file the corpus is built with (default: $PRX_CONFIG): "
                                       "named in the command printed for Dagster's CLI")
    sync.set_defaults(func=sync_sources)


def sync_sources(args: argparse.Namespace) -> int:
    """Adds a partition per catalog source, removes those the catalog dropped, and says how to use them."""
    from prx_core.sources.catalog import load_catalog

    from prx_assets.settings import SettingsError

    catalog = load_catalog(os.path.abspath(args.sources))  # a bad catalog fails here, before dagster loads
    if args.config and not os.path.isfile(args.config):
        raise SettingsError(f"--config: {args.config} is not a file")

    from prx_cli.build import prepare_instance
    from prx_assets.common import sync_partitions
    from prx_cli.homes import corpus_root

    instance = prepare_instance(args.dagster_home, args.root)
    home = os.environ["DAGSTER_HOME"]
    added, removed = sync_partitions(instance, catalog)
    print(f"dagster home {home}\npartitions of `sources`: {', '.join(catalog.names)}"
          f" (added {', '.join(added) or 'none'}; removed {', '.join(removed) or 'none'})")
    from prx_assets.settings import DEFAULT_ROOT

    root = args.root or os.environ.get("PRX_ROOT") or str(DEFAULT_ROOT)  # the root whose home prepare_instance took
    config = args.config or os.environ.get("PRX_CONFIG")
    env = f"DAGSTER_HOME={home} PRX_ROOT={corpus_root(root)} PRX_SOURCES={os.path.abspath(args.sources)}" + (
        f" PRX_CONFIG={os.path.abspath(config)}" if config else "")  # all the definitions read (prx_assets.settings)
    print(f"e.g. {env} dagster asset materialize -m prx_assets.definitions --select raw_source,samples "
          f"--partition {catalog.names[0]}" if catalog.names else "the catalog lists no source")
    return 0
