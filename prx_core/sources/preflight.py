"""Checks made before a build starts Ray: the root is writable, each source is where the catalog says.

A wrong `uri`, a column the files do not have, or a root the build cannot write otherwise costs a
Ray start and fails in the middle of a run, under its own traceback. Here each is one line naming
the source, the field and the fix, found in about a second: a source's folder is looked into only
as far as its first few files of its format (`prx_core.sources.listing`), a table's columns are
read from the first file's schema (its footer, a Lance manifest), never its rows. The checks use
the readers' own rules (which files are shards, data files or images; which column a Hugging Face
dataset's images are in), so what passes here is what the run will read. An image folder's or a
WebDataset's `caption_column` is checked against its metadata files or first shard's members
(`prx_core.sources.preflight_captions`). `prx-corpus build` and `prx-corpus plan` call it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prx_core.sources.catalog import JoinSpec, SourceSpec
from prx_core.sources.listing import Look, exists, first_files
from prx_core.sources.records import IMAGE_EXTENSIONS
from prx_core.store.storage import Storage

URI_FIX = "point uri at the source's file or folder (a relative path resolves against the catalog's folder)"
ROOT_FIX = ("give --root a folder (or s3://bucket/prefix) this user can write, with its storage_options and "
            "credentials for a bucket; `prx-corpus doctor --root URI` checks it")
WHAT = {"parquet": ".parquet file", "webdataset": ".tar shard (.tar, .tar.gz, .tgz)",
        "huggingface": ".arrow or .parquet data file", "imagefolder": f"image file ({', '.join(IMAGE_EXTENSIONS)})"}


@dataclass(frozen=True)
class Problem:
    """One reason the build would fail: what, which field, and how to fix it."""

    subject: str  # "corpus root (--root)" or "source 'name'"
    field: str  # the catalog field ("" for the root)
    problem: str
    fix: str

    def line(self) -> str:
        where = f"{self.subject}: field '{self.field}'" if self.field else self.subject
        return f"{where}: {self.problem}; fix: {self.fix}"


def preflight(storage: Storage, sources: Iterable[SourceSpec], check_sources: bool = True) -> list[Problem]:
    """Every problem found with the root and (with `check_sources`) the sources, in catalog order."""
    problems = check_root(storage)
    if check_sources:
        for spec in sources:
            problems += check_source(spec, storage.storage_options)
    return problems


def check_root(storage: Storage) -> list[Problem]:
    """The root takes a probe object (written, read back, deleted). A local folder the probe had to
    create is removed again: a build that stops here leaves nothing behind."""
    created = [] if storage.is_remote else _missing_folders(storage.root)
    try:
        ok, message = storage.check_writable()
    finally:
        for folder in created:  # innermost first; only what is still empty
            try:
                os.rmdir(folder)
            except OSError:
                break
    return [] if ok else [Problem("corpus root (--root)", "", f"not writable: {message}", ROOT_FIX)]


def _missing_folders(path: str) -> list[str]:
    missing = []
    while path and not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def check_source(spec: SourceSpec, options: dict[str, Any] | None) -> list[Problem]:
    """The source's uri exists and holds its format's files; the columns the catalog names are in
    the first file's schema; each joined table likewise."""
    subject = f"source {spec.name!r}"
    try:
        if not exists(spec.uri, options):
            return [Problem(subject, "uri", f"{spec.uri} does not exist", URI_FIX)]
        if spec.format == "lance":
            problems = _lance_columns(subject, spec.uri, _source_columns(spec), options)
        else:
            problems = _files_and_columns(spec, subject, options)
        for index, join in enumerate(spec.joins):
            problems += _join_problems(subject, index, join, options)
        return problems
    except Exception as exc:  # a permission, credentials, an unreachable endpoint: the run would fail alike
        return [Problem(subject, "uri", f"cannot read {spec.uri}: {type(exc).__name__}: {exc}",
                        "check the path's permissions, or the bucket's storage_options and credentials")]


def _source_columns(spec: SourceSpec) -> dict[str, str]:
    """field -> column for every column the catalog names for the source's own table."""
    named = {f: getattr(spec, f) for f in ("image_column", "url_column", "caption_column", "key_column",
                                           "embedding_column") if getattr(spec, f)}
    return {**named, **{f"metadata_columns[{i}]": c for i, c in enumerate(spec.metadata_columns)}}


def _wanted(fmt: str) -> Callable[[str], bool]:
    from prx_core.sources.folders.reader import extension
    from prx_core.sources.hf_datasets import is_data_file
    from prx_core.sources.tars import is_shard

    return {"parquet": lambda p: p.lower().endswith(".parquet"), "webdataset": is_shard,
            "huggingface": is_data_file, "imagefolder": lambda p: extension(p) in IMAGE_EXTENSIONS}[fmt]


def _files_and_columns(spec: SourceSpec, subject: str, options: dict[str, Any] | None) -> list[Problem]:
    look = first_files(spec.uri, _wanted(spec.format), options)
    if not look.matches:
        if not look.exhaustive:  # only the first entries were looked at: the run's own listing decides
            return []
        return [Problem(subject, "uri", f"no {WHAT[spec.format]} under {spec.uri} ({_holds(spec.format, look)})",
                        f"{URI_FIX}, or set the format its files are in")]
    if spec.format in ("parquet", "huggingface"):
        return _table_columns(spec, subject, look.matches[0], options)
    from prx_core.sources.preflight_captions import caption_problems  # metadata files, shard members

    return [Problem(subject, "caption_column", problem, fix) for problem, fix in caption_problems(spec, look.matches, options)]


def _holds(fmt: str, look: Look) -> str:
    from prx_core.sources.readers import describe_files

    return describe_files(fmt, look.others) if look.others else "it holds no file"


def _table_columns(spec: SourceSpec, subject: str, path: str, options: dict[str, Any] | None) -> list[Problem]:
    """Named columns missing from the first data file; for a Hugging Face dataset the image and
    caption columns its features give (`hf_datasets.resolve_columns`, the reader's own rule)."""
    from prx_core.sources.hf_datasets import file_schema, resolve_columns

    schema = file_schema(path, options)
    if spec.format == "huggingface":
        try:
            spec = resolve_columns(spec, schema, path)
        except ValueError as exc:
            return [Problem(subject, "image_column", str(exc).removeprefix(f"{subject}: "),
                            "name the image column in the catalog (image_column: <column>)")]
    return _missing(subject, "", _source_columns(spec), schema.names, path)


def _lance_columns(subject: str, uri: str, columns: dict[str, str], options: dict[str, Any] | None,
                   prefix: str = "") -> list[Problem]:
    import lance

    from prx_core.sources.tables import lance_options

    try:
        dataset = lance.dataset(uri, storage_options=lance_options(uri, options))
    except (ValueError, OSError) as exc:
        return [Problem(subject, f"{prefix}uri", f"{uri} is not a Lance dataset ({' '.join(str(exc).split())[:200]})",
                        "point it at a Lance dataset folder (<name>.lance), or set the format its files are in")]
    return _missing(subject, prefix, columns, dataset.schema.names, uri)


def _missing(subject: str, prefix: str, columns: dict[str, str], names: list[str], path: str) -> list[Problem]:
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    return [Problem(subject, f"{prefix}{field}", f"column {column!r} is not in {path} (its columns: {shown})",
                    f"set {prefix}{field} to one of its columns")
            for field, column in columns.items() if column not in names]


def _join_problems(subject: str, index: int, join: JoinSpec, options: dict[str, Any] | None) -> list[Problem]:
    prefix = f"joins[{index}]."
    columns = {f: getattr(join, f) for f in ("key_column", "caption_column", "embedding_column") if getattr(join, f)}
    columns.update({f"metadata_columns[{i}]": c for i, c in enumerate(join.metadata_columns)})
    if not exists(join.uri, options):
        return [Problem(subject, f"{prefix}uri", f"{join.uri} does not exist", URI_FIX.replace("source's", "table's"))]
    if join.format == "lance":
        return _lance_columns(subject, join.uri, columns, options, prefix)
    look = first_files(join.uri, lambda p: p.lower().endswith(".parquet"), options)
    if not look.matches:
        if not look.exhaustive:
            return []
        return [Problem(subject, f"{prefix}uri", f"no .parquet file under {join.uri} ({_holds('parquet', look)})",
                        "point it at a parquet file or a folder of them, or give format: lance")]
    from prx_core.sources.hf_datasets import file_schema

    return _missing(subject, prefix, columns, file_schema(look.matches[0], options).names, look.matches[0])

