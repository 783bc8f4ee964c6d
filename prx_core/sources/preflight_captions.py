"""Preflight for the caption column of the sources whose captions are not a table column.

A table's `caption_column` is checked against its first file's schema (`prx_core.sources.preflight`).
An image folder's names a column of its `metadata.jsonl` / `metadata.csv` files, a WebDataset's a
member extension (`txt`) or a field of a JSON member (`json.caption`): a wrong one costs no error at
ingest (every sample comes through without a caption, a `caption_error` note each) and fails the
build much later, in `captions` or `mds_shards`, naming neither the field nor the fix. Here it is
one line before Ray starts, found as cheaply as the other checks: the metadata files' headers (a
CSV's first line, a JSONL's first lines) and the first members of the first shard, never whole
files. Only a column set in the catalog is checked (the defaults are conventions a source may not
follow), and only a conclusive look fails: a folder looked into only partly raises no problem.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import tarfile
from typing import Any

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders.metadata import METADATA_FILENAMES
from prx_core.sources.listing import exists, first_files
from prx_core.sources.records import CAPTION_EXTENSIONS
from prx_core.sources.sample_metadata import field_at
from prx_core.store.storage import filesystem_for, is_remote

HEAD_LINES = 20  # JSONL lines read for their keys
HEAD_BYTES = 1 << 20  # at most this much of a metadata file
SHARD_MEMBERS = 200  # tar members looked at in the first shard
SHOWN = 12


def caption_problems(spec: SourceSpec, shards: list[str], options: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(problem, fix) for a `caption_column` that the source's files do not have; `shards` are the
    first shards a bounded look found (webdataset)."""
    if not spec.caption_column:
        return []
    if spec.format == "imagefolder":
        return _folder_problems(spec, options)
    if spec.format == "webdataset" and shards:
        return _shard_problems(spec, shards[0], options)
    return []


def _folder_problems(spec: SourceSpec, options: dict[str, Any] | None) -> list[tuple[str, str]]:
    column = spec.caption_column
    files, conclusive = metadata_files(spec.uri, options)
    if not files:
        if not conclusive:
            return []
        return [(f"caption_column {column!r} names a column of a metadata file (metadata.jsonl or metadata.csv) and "
                 f"{spec.uri} holds none",
                 "remove caption_column (sidecar <stem>.txt captions need none), or add the metadata file")]
    seen: dict[str, list[str]] = {}
    for path in files:
        columns = metadata_columns(path, options)
        if column in columns:
            return []
        seen[path] = columns
    shown = "; ".join(f"{path}: {', '.join(cols[:SHOWN]) or 'no column read'}" for path, cols in seen.items())
    candidates = sorted({c for cols in seen.values() for c in cols} - {"file_name"})
    return [(f"column {column!r} is in no metadata file of the source ({shown})",
             f"set caption_column to one of {', '.join(candidates[:SHOWN])}" if candidates
             else "write the captions into the metadata file, or remove caption_column")]


def metadata_files(uri: str, options: dict[str, Any] | None) -> tuple[list[str], bool]:
    """The root's own metadata files, then the first ones a bounded look finds below it; whether
    the look saw every entry."""
    root = [posixpath.join(uri, name) for name in METADATA_FILENAMES if exists(posixpath.join(uri, name), options)]
    look = first_files(uri, lambda p: posixpath.basename(p) in METADATA_FILENAMES, options)
    found = list(dict.fromkeys(root + look.matches))
    if not is_remote(uri):  # the reader never follows a link: neither does its check
        found = [p for p in found if not os.path.islink(p)]
    return found, look.exhaustive


def metadata_columns(path: str, options: dict[str, Any] | None) -> list[str]:
    """A metadata file's columns: a CSV's header, the keys of a JSONL's first lines (in order)."""
    with filesystem_for(path, options).open(path, "rb") as handle:
        head = handle.read(HEAD_BYTES)
    text = head.decode("utf-8", errors="replace")
    if path.endswith(".csv"):
        return next(csv.reader(io.StringIO(text)), [])
    keys: dict[str, None] = {}
    for line in text.splitlines()[:HEAD_LINES]:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            keys.update(dict.fromkeys(k for k in row if isinstance(k, str)))
    return list(keys)


def _shard_problems(spec: SourceSpec, shard: str, options: dict[str, Any] | None) -> list[tuple[str, str]]:
    from prx_core.sources.tars import GZIP_SUFFIXES, JSON_EXT, caption_rule, member_key
    from prx_core.sources.tar_headers import BoundedTarInfo

    rule = caption_rule(spec.caption_column)
    exts: dict[str, None] = {}
    fields: dict[str, None] = {}
    with filesystem_for(shard, options).open(shard, "rb") as handle:
        mode = "r|gz" if shard.lower().endswith(GZIP_SUFFIXES) else "r|"
        try:
            with tarfile.open(fileobj=handle, mode=mode, tarinfo=BoundedTarInfo) as tar:
                for count, member in enumerate(tar):
                    if count >= SHARD_MEMBERS:
                        break
                    if not member.isfile():
                        continue
                    ext = member_key(member.name)[1]
                    exts[ext] = None
                    if ext in rule.text_exts:
                        return []
                    if rule.json_paths and ext == rule.json_ext and member.size <= spec.max_caption_bytes:
                        found = _json_field(tar.extractfile(member), rule.json_paths[0], fields)
                        if found:
                            return []
        except (tarfile.TarError, EOFError, OSError):  # a broken shard: the reader refuses it with its own error
            return []
    if not exts:
        return []
    named = ".".join((rule.json_ext, *rule.json_paths[0])) if rule.json_paths else rule.text_exts[0]
    where = f"the first samples of {shard} (members: {', '.join(list(exts)[:SHOWN])}"
    where += f"; .{rule.json_ext} fields: {', '.join(list(fields)[:SHOWN])})" if fields else ")"
    options_ = [e for e in exts if e in CAPTION_EXTENSIONS or e.endswith(".txt")] + [f"{JSON_EXT}.{f}" for f in fields]
    fix = (f"set caption_column to {' or '.join(options_[:4])}" if options_
           else "set caption_column to the member extension (txt) or JSON field (json.caption) holding the captions")
    return [(f"caption_column {spec.caption_column!r}: no .{named.split('.')[0] if rule.json_paths else named} "
             f"member{' with that field' if rule.json_paths else ''} in {where}", fix)]


def _json_field(handle: Any, path: tuple[str, ...], fields: dict[str, None]) -> bool:
    """Whether the JSON member has the field path; its top-level keys go into `fields`."""
    if handle is None:
        return False
    try:
        obj = json.loads(handle.read())
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    fields.update(dict.fromkeys(k for k in obj if isinstance(k, str)))
    return field_at(obj, path)[0]
