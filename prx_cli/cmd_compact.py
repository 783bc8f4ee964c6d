"""`prx-corpus compact`: what the nightly `compact_corpus` Dagster job runs (prx_core.ops.compaction),
from a shell and without a Dagster instance: after a large backfill or an opt-out, or on a corpus
whose Dagster deployment is not running. It starts (or connects to) Ray as `prx-corpus build` does.
"""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_compact(args: argparse.Namespace) -> int:
    from prx_assets.settings import load_settings
    from prx_core.compute.quiet import start_ray
    from prx_core.ops.compaction import maintain_corpus
    from prx_core.shards.mds.retention import RETENTION_SECONDS
    from prx_core.store import lance_io
    from prx_core.store.storage import Storage

    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    os.environ.setdefault("LANCE_LOG", "error")
    settings = load_settings()
    storage = Storage(args.root, settings.section("storage").get("storage_options") or {})
    if not lance_io.table_exists(storage.lance_uri("samples"), storage.lance_storage_options()):
        print(f"prx-corpus compact: error: no corpus at {storage.root}: its samples table does not exist",
              file=sys.stderr)
        return 2
    import ray

    start_ray(**settings.ray_start())  # the configured cluster, else an embedded Ray
    try:
        retention = RETENTION_SECONDS if args.retention_hours is None else args.retention_hours * 3600
        result = maintain_corpus(storage, retention, on_table=lambda done: print(done.line(), flush=True))
    finally:
        ray.shutdown()
    for line in result.pruned_lines():
        print(line)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `compact` to the `prx-corpus` subcommands."""
    compact = sub.add_parser("compact", help="compact every Lance table, clean old versions and prune superseded MDS "
                                             "chunks and tier manifests now (the nightly compact_corpus job's work)")
    compact.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    compact.add_argument("--config", help="YAML: storage.storage_options for an object store, ray.address for a cluster")
    compact.add_argument("--retention-hours", type=float, metavar="H",
                         help="superseded MDS chunks and tier manifests older than this go (default: the job's "
                              "mds_retention_hours, 7 days: longer than any training job holds an old index)")
    compact.set_defaults(func=_cmd_compact)
