"""`prx-corpus opt-out`, `prx-corpus rewrite-stream` and `prx-corpus manifest`: the runbooks of
docs/operations.md that need a tool. They call `prx_core` directly (no Dagster run, no Ray): each holds the partition
locks of what it writes, so it fails at once, naming the writer, while a build writes the source.
"""

from __future__ import annotations

import argparse
import os
import sys

OLD_BYTES = ("the deleted rows' bytes stay in Lance data files (deletion vectors) and old table versions, "
             "and the superseded MDS chunks on disk, until `compact_corpus` runs after the retention "
             "(mds_retention_hours, 7 days); to remove them now, rerun the same command with --purge")


def _storage(root: str, config: str | None):  # -> Storage
    from prx_assets.settings import load_settings
    from prx_core.store.storage import Storage

    if config:
        os.environ["PRX_CONFIG"] = os.path.abspath(config)
    return Storage(root, load_settings().section("storage").get("storage_options") or {})


def _training():  # -> TrainingResource, from the config `_storage` selected
    from prx_assets.settings import load_settings
    from prx_resources import TrainingResource

    return TrainingResource(**load_settings().section("training"))


def _missing_corpus(storage) -> str | None:  # storage: Storage
    """Why `storage` is not a corpus these commands can work on, or None."""
    from prx_core.store import lance_io

    if not lance_io.table_exists(storage.lance_uri("samples"), storage.lance_storage_options()):
        return f"no corpus at {storage.root}: its samples table does not exist (run prx-corpus build first)"
    return None


def _fail(command: str, exc: BaseException, code: int = 1) -> int:
    print(f"prx-corpus {command}: error: {exc}", file=sys.stderr)
    return code


def _errors() -> tuple[type[BaseException], ...]:
    from prx_core.shards.skiplists.records import UnfilteredStream
    from prx_core.store.locks import LockLost, LockUnsupported, PartitionLocked

    return UnfilteredStream, PartitionLocked, LockLost, LockUnsupported


def _cmd_opt_out(args: argparse.Namespace) -> int:
    from prx_core.sources.catalog import load_catalog
    from prx_core.stages.opt_out.apply import opt_out

    if not os.path.isfile(args.ids):
        return _fail("opt-out", f"--ids {args.ids}: no such file (one sample id a line: <source>/<source_key>)", 2)
    if (args.purge or args.with_copies or args.discard_attempts) and not args.delete_bytes:
        return _fail("opt-out", "--purge, --with-copies and --discard-attempts are a takedown's: they need "
                                "--delete-bytes", 2)
    catalog = load_catalog(args.sources)
    storage = _storage(args.root, args.config)
    if missing := _missing_corpus(storage):
        return _fail("opt-out", missing, 2)
    try:
        report = opt_out(storage, args.ids, catalog.names, args.delete_bytes, args.purge, examples=args.examples,
                         discard_attempts=args.discard_attempts, with_copies=args.with_copies)
    except _errors() as exc:
        return _fail("opt-out", exc)
    print(f"opt-out: {report.read} ids read, {report.matched} matched ({report.in_streams} in published streams), "
          f"{report.unknown} unknown, {report.malformed} malformed")
    if report.examples:
        print(f"unknown or malformed (first {len(report.examples)}): {', '.join(report.examples)}")
    if args.delete_bytes:
        print("deleted rows: " + ", ".join(f"{t} {n}" for t, n in report.deleted_rows.items()))
        print(f"streams republished without them: {len(report.streams)}")
        for rewrite in report.rewrites:
            state = "unpublished (empty)" if rewrite.unpublished else f"{rewrite.before} -> {rewrite.after} samples"
            print(f"  {rewrite.stream}: {state}, {rewrite.chunks_rewritten} chunks rewritten")
        _print_copies(report.copies, args.with_copies)
        if args.purge:
            done = report.purge
            versions = sum(done.versions.values())
            print(f"purged: {len(done.chunks)} superseded chunk folders, {versions} old table versions, "
                  f"{sum(done.content_rows.values())} rows keyed by a content no sample holds, {done.join_rows} staged "
                  f"join rows; indexes rebuilt: {', '.join(done.indexes_rebuilt) or '-'}")
            for attempt in done.discarded:
                print(f"  discarded the abandoned attempt {attempt}")
            if not done.complete:
                for pinned in done.pinned:
                    print(f"  kept {pinned.line()}: it still holds the deleted rows")
                print(f"audit record: {report.record}")
                return _fail("opt-out", "takedown incomplete: versions pinned by uncommitted attempts keep the deleted "
                                        "rows; rerun with --discard-attempts once no build of these sources runs (or "
                                        "after those assets' next runs)")
        else:
            print(f"note: {OLD_BYTES}")
    else:
        print(f"skip-lists republished (opt_out): {len(report.streams)} streams")
        for stream in report.streams:
            print(f"  {stream}")
        if report.streams:
            print("note: a later skip_lists materialization recomputes the lists from the skip policy: rerun this "
                  "command after it (same file, idempotent), or use --delete-bytes for a takedown")
    print(f"audit record: {report.record}")
    return 0


def _print_copies(copies: dict[str, str], taken: bool, shown: int = 20) -> None:
    """The other samples of the same pictures: taken down too (`--with-copies`), or left."""
    if not copies:
        return
    what = "taken down too (--with-copies)" if taken else "NOT taken down (--with-copies takes them down too)"
    print(f"copies of the same pictures, {what}: {len(copies)}")
    for sample, why in list(copies.items())[:shown]:
        print(f"  {sample}: {why}")


def _cmd_rewrite_stream(args: argparse.Namespace) -> int:
    from prx_core.stages.rewrite_streams import parse_stream, rewrite_skipped, skip_fraction, streams_over

    storage = _storage(args.root, args.config)
    if missing := _missing_corpus(storage):
        return _fail("rewrite-stream", missing, 2)
    try:
        if args.stream:
            try:
                source, key = parse_stream(args.stream)
            except ValueError as exc:
                return _fail("rewrite-stream", exc, 2)
            targets = [skip_fraction(storage, source, key)]
        else:
            targets = streams_over(storage, args.over)
            print(f"{len(targets)} streams skip more than {args.over:.0%}")
        for target in targets:
            done = rewrite_skipped(storage, target.source, target.key)
            print(f"  {target.name}: {target.fraction:.1%} skipped, {done.before} -> {done.after} samples, "
                  f"{done.chunks_rewritten} of {done.chunks_rewritten + done.chunks_kept} chunks rewritten; "
                  "skip fraction now 0")
    except _errors() as exc:
        return _fail("rewrite-stream", exc)
    except FileNotFoundError as exc:
        return _fail("rewrite-stream", f"{exc}: is it a published stream of this root?", 2)
    return 0


def _cmd_manifest(args: argparse.Namespace) -> int:
    from prx_core.shards.manifest import read_manifest_header
    from prx_core.shards.manifest_publish import manifest_sources, publish_source_manifest
    from prx_core.stages.opt_out.apply import SKIP_LOCKS
    from prx_core.store.locks import partition_locks

    storage = _storage(args.root, args.config)
    sources = args.source or manifest_sources(storage.root, storage.storage_options)
    if not sources:
        return _fail("manifest", f"no published stream under {storage.root}/mds: nothing to list", 2)
    current: dict[int, str] = {}
    try:
        for source in sources:
            with partition_locks(storage, source, SKIP_LOCKS, "prx-corpus manifest"):
                current.update(publish_source_manifest(storage.root, source, storage.storage_options))
    except _errors() as exc:
        return _fail("manifest", exc)
    refused: dict[str, str] = {}
    minimum = _training().stream_minimum()
    for tier, name in sorted(current.items()):
        header = read_manifest_header(storage.root, tier, name, storage.storage_options)
        samples = sum(s["count"] for s in header["streams"])
        small = sum(s["count"] < minimum for s in header["streams"])
        print(f"tier {tier}: {name}: {len(header['streams'])} streams, {samples} samples, {header['count']} skipped, "
              f"{len(header['refused'])} refused, {small} below {minimum} samples (one global batch x canonical nodes)")
        refused.update(header["refused"])
    for stream, why in sorted(refused.items()):
        print(f"  refused {stream}: {why}")
    if refused:
        print(f"note: the loader refuses the sources of these {len(refused)} streams until skip_lists is materialized "
              "for them (their skips are unknown)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `opt-out`, `rewrite-stream` and `manifest` to the `prx-corpus` subcommands."""
    opt = sub.add_parser("opt-out", help="skip (or with --delete-bytes, delete) a file of sample ids: skip-lists, "
                                         "samples and the MDS streams that held them (docs/operations.md)")
    opt.add_argument("--ids", required=True, help="file of sample ids, one a line: <source>/<source_key>")
    opt.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    opt.add_argument("--sources", required=True, help="the sources.yaml catalog (ids of other sources are unknown)")
    opt.add_argument("--delete-bytes", action="store_true",
                     help="a takedown: delete the rows from samples (and buckets, phashes, source_embeddings) and "
                          "republish the streams that held them without them")
    opt.add_argument("--purge", action="store_true",
                     help="with --delete-bytes: remove every copy now, also of earlier takedowns of these sources "
                          "(superseded chunks, fragments with deleted rows, old versions, rows keyed by a content no "
                          "sample holds, staged joins, index segments); exits 1 if an attempt pins a version")
    opt.add_argument("--discard-attempts", action="store_true",
                     help="with --purge: discard these sources' abandoned (uncommitted) attempts under their locks, "
                          "so the versions they pin can go")
    opt.add_argument("--with-copies", action="store_true",
                     help="with --delete-bytes: also take down the other samples holding the same picture (same "
                          "bytes, or the same duplicate group), which are listed either way")
    opt.add_argument("--examples", type=int, default=20, help="unknown ids listed (default 20)")
    opt.add_argument("--config", help="YAML whose storage.storage_options reach an object store")
    opt.set_defaults(func=_cmd_opt_out)

    rewrite = sub.add_parser("rewrite-stream", help="republish a stream without its skipped samples (or every stream "
                                                     "skipping more than --over)")
    rewrite.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    which = rewrite.add_mutually_exclusive_group(required=True)
    which.add_argument("--stream", help="<source>/<tier>/<w>x<h>, as warnings and the loader name it")
    which.add_argument("--over", type=float, help="every stream whose skipped share exceeds this (e.g. 0.10)")
    rewrite.add_argument("--config", help="YAML whose storage.storage_options reach an object store")
    rewrite.set_defaults(func=_cmd_rewrite_stream)

    manifest = sub.add_parser("manifest", help="republish the tier manifests the training loader reads (a corpus "
                                               "written before manifests, or a repair)")
    manifest.add_argument("--root", required=True, help="corpus root: a folder or s3://bucket/prefix")
    manifest.add_argument("--source", action="append", help="only this source's part (repeatable; default: all)")
    manifest.add_argument("--config", help="YAML whose storage.storage_options reach an object store")
    manifest.set_defaults(func=_cmd_manifest)
