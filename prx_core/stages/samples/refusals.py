"""Why a source yielded no sample, in one line an operator can act on.

A source whose every sample is refused (or that lists no file) fails its `samples` run
(`SourceRefused`) with one line: the source, how many rows were
refused, the dominant reject reason with its count, one example (its key and message) and the
likely fix from `HINTS` (and `FILE_HINTS` for folder and tar sources), tables keyed by reject reason. The examples come from the work
units' summaries (`examples_by_reason`), so the line is built without reading `rejects` back.
`refuse_nothing` decides, for a run that kept no sample, whether it raises before its commit or
after (its rejects committed for inspection).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from prx_core.compute.unit_results import UnitResults
from prx_core.sources.catalog import SourceSpec
from prx_core.store import lance_io
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

EXAMPLE_CHARS = 240  # an example message, cut: the whole of it is in rejects.lance
KEY_CHARS = 160

# reject reason -> the likely fix; a reason without an entry gets GENERIC_HINT.
HINTS: dict[str, str] = {
    "not_an_image": "the image column holds something other than image bytes (URLs? name that column "
                    "`url_column` and the images are fetched; paths? check `image_column`)",
    "empty": "the image column is empty or null (a metadata-only table? name its URL column `url_column`)",
    "unreadable_fragment": "the files cannot be read as `format: {format}`: check the source's format, uri and "
                           "column names in the catalog against the files",
    "unreadable_file": "the files cannot be opened (permissions? credentials in storage_options?)",
    "path_outside_source": "the Image() paths point outside the source's uri: embed the images' bytes in the table, "
                           "or point uri at a folder holding both the table and the images",
    "download_error": "no URL gave an image: check the URL column and that the workers reach those hosts "
                      "(each reject's message has the HTTP status or error)",
    "download_timeout": "every fetch timed out: check the workers' network, or raise `download` timeouts",
    "not_fetched": "the ingest unit's time for fetching ran out before these URLs were fetched: raise "
                   "`units.samples_seconds`, make units smaller (`units.samples_rows`) or fetch more at once "
                   "(`download.concurrency`); a re-ingest fetches them again",
    "opted_out": "every server opted out of AI use (X-Robots-Tag noai/noimageai): these images are not taken",
    "url_not_allowed": "the URLs point at addresses, objects or files this source may not reach (non-public "
                       "networks, other buckets, local files): if that is intended, allow them in its `download` "
                       "settings (allow_networks, allow_object_prefixes, allow_files)",
    "taken_down": "every row is named by a recorded takedown (_state/takedowns/): nothing of it may be ingested",
    "format_not_allowed": "the images are in a format the corpus does not take (JPEG, PNG, WebP, TIFF, ...)",
    "too_many_pixels": "every image is over the pixel cap (storage.max_pixels)",
    "image_too_large": "every image file is over the source's `max_image_bytes`",
    "caption_too_large": "every caption is over the source's `max_caption_bytes`",
    "truncated": "the image files are cut short: check how they were copied",
    "corrupt_image": "the image bytes are damaged: check how they were written or copied",
    "decode_error": "the images do not decode: check how they were written or copied",
    "null_key": "the key column is null in every row: check `key_column`",
    "duplicate_key": "every key repeats: check `key_column` (it must be unique per sample)",
    "bad_name": "the file or member names are not UTF-8",
    "symlink": "the folder holds symlinks, which are never followed: point uri at the real files",
    "not_regular_file": "the folder holds special files, not images",
}
# an unreadable_fragment whose unit ran past its time limit: no format problem
TIME_LIMIT_HINT = ("the ingest unit ran past its time limit and was cancelled: raise `units.samples_seconds` or make "
                   "units smaller (`units.samples_bytes`; a URL table's `units.samples_rows`, an image folder's "
                   "`units.samples_files`)")
# where a source's images are files (not a table column), these reasons mean something else
FILE_FORMATS = ("imagefolder", "webdataset")
FILE_HINTS: dict[str, str] = {
    "not_an_image": "the files named as images are not images (text or HTML saved under an image name? a failed "
                    "download?): check how they were fetched or written",
    "empty": "the image files are empty (0 bytes): check how they were fetched or copied",
}
GENERIC_HINT = "see the rejects (rejects.lance, stage samples, or the explorer) for every refused row"


class SourceRefused(RuntimeError):
    """The source yielded no sample: its message is the one line saying why (source, counts, the
    dominant reject reason with an example, the likely fix), printed as is by the asset and CLI."""


class EmptySource(SourceRefused):
    """The source yielded no sample while its partition holds rows: refused, not emptied."""


def examples_by_reason(refused: pa.Table) -> dict[str, dict[str, str]]:
    """The first reject of each reason in a unit's rejects, as {reason: {key, message}}: kept in
    the unit's summary so a source refused whole can name an example without a read."""
    examples: dict[str, dict[str, str]] = {}
    if refused.num_rows == 0:
        return examples
    reasons = refused["reason"].to_pylist()
    for i, reason in enumerate(reasons):
        if reason not in examples:
            examples[reason] = {"key": str(refused["source_key"][i].as_py() or ""),
                                "message": one_line(str(refused["message"][i].as_py() or ""), EXAMPLE_CHARS)}
    return examples


def first_examples(summaries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Per reason, the example of the first unit (in plan order) that has one."""
    out: dict[str, dict[str, str]] = {}
    for summary in summaries:
        for reason, example in (summary.get("examples") or {}).items():
            out.setdefault(reason, example)
    return out


def refused_line(spec: SourceSpec, reasons: Mapping[str, int], examples: Mapping[str, Mapping[str, str]]) -> str:
    """`source 'x' (fmt at uri): N of N rows refused (reason n: key: "message"; also ...); fix`."""
    ranked = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    total = sum(reasons.values())
    reason, count = ranked[0]
    example = examples.get(reason) or {}
    shown = f"{reason} {count}"
    if example:
        shown += f", e.g. {one_line(example.get('key', ''), KEY_CHARS)}: \"{example.get('message', '')}\""
    others = ", ".join(f"{r} {n}" for r, n in ranked[1:4]) + (", ..." if len(ranked) > 4 else "")
    also = f"; also {others}" if others else ""
    fix = TIME_LIMIT_HINT if reason == "unreadable_fragment" and "time limit" in example.get("message", "") \
        else hint(reason, spec)
    return (f"source {spec.name!r} ({spec.format} at {spec.uri}): {total} of {total} rows refused, none kept "
            f"({shown}{also}). Likely fix: {fix}")


def nothing_read_line(spec: SourceSpec, listed: int) -> str:
    """A source that listed no file, or whose files held no row at all."""
    what = "matched no file" if listed == 0 else f"listed {listed} files or folders holding no row"
    return (f"source {spec.name!r} ({spec.format} at {spec.uri}) {what}: nothing to ingest. Likely fix: check the "
            f"source's uri (a folder, a glob, an s3:// prefix) and that `format: {spec.format}` matches its files; "
            "to empty the partition on purpose, rerun `samples` with run config `allow_empty: true`")


def hint(reason: str, spec: SourceSpec) -> str:
    """The fix for `reason` from the tables above (file sources first where they differ)."""
    return fix_for(reason, spec.format)


def fix_for(reason: str, fmt: str) -> str:
    """`hint` by the source's format alone (what `prx-corpus plan` knows of a sampled reject)."""
    table = {**HINTS, **FILE_HINTS} if fmt in FILE_FORMATS else HINTS
    return table.get(reason, GENERIC_HINT).format(format=fmt)


def one_line(text: str, limit: int) -> str:
    """Whitespace (newlines of a traceback or a multi-line error) collapsed, cut at `limit`."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def refuse_nothing(spec: SourceSpec, storage: Storage, listed: int, results: UnitResults) -> str:
    """For a run that kept no sample: raise before any commit (nothing read, or a partition holding
    samples to keep), or return the line to raise once its rejects are committed."""
    if results.total("rejected") == 0:
        refuse_emptying(spec, storage, listed)
        raise SourceRefused(nothing_read_line(spec, listed))
    line = refused_line(spec, results.counts("reasons"), first_examples(results.summaries))
    held = held_rows(spec, storage, ("samples",))
    if held:
        raise EmptySource(f"{line}. Its partition holds {held} samples: kept whole, nothing committed (to empty it "
                          "on purpose, rerun `samples` with run config `allow_empty: true`)")
    return line + ". The refused rows are in rejects (stage samples; the explorer's rejects page)"


def refuse_emptying(spec: SourceSpec, storage: Storage, fragments: int) -> None:
    """Raise `EmptySource` when the partition of an empty source holds rows (samples or rejects)."""
    held = held_rows(spec, storage, ("samples", "rejects"))
    if held:
        raise EmptySource(
            f"source {spec.name!r} ({spec.format} at {spec.uri}) yielded no sample ({fragments} files or folders "
            f"listed), and its partition holds {held} rows: refusing to replace them with nothing. Fix the "
            "source's uri (or restore its files), or, to empty the partition on purpose, rerun `samples` with "
            "run config `allow_empty: true`.")


def held_rows(spec: SourceSpec, storage: Storage, tables: tuple[str, ...]) -> int:
    """Rows the source's partition holds in `tables` (`rejects`: its samples-stage rows)."""
    options = storage.lance_storage_options()
    predicates = {"samples": source_predicate(spec.name), "rejects": rejects_predicate(spec.name, "samples")}
    held = 0
    for table in tables:
        dataset = lance_io.open_table(storage.lance_uri(table), options)
        held += dataset.count_rows(filter=predicates[table]) if dataset is not None else 0
    return held
