"""A bounded look into a source's folder: the first few files of its format, never the whole listing.

The readers list a source whole when they plan its units (`prx_core.sources.readers`); a check
made before a build (`prx_core.sources.preflight`) must answer in about a second even for a
folder of 100M files. `first_files` stops at the first `limit` files its predicate accepts, or
after looking at `budget` entries, and says whether it saw everything: only an exhaustive look
may conclude that a folder holds no file of its format.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prx_core.store.storage import filesystem_for, is_remote

FIRST_FILES = 3  # files of the format enough to read a schema and know the format is right
BUDGET = 2000  # entries looked at, at most (one S3 list request of 1000 keys, or two)
OTHERS = 50  # other files kept, to say what a folder holds instead


@dataclass
class Look:
    """What a bounded look found under a source's `uri`."""

    matches: list[str] = field(default_factory=list)  # full paths/URIs the predicate accepted
    others: list[str] = field(default_factory=list)  # a few files it did not accept
    exhaustive: bool = True  # every entry under uri was looked at


def exists(uri: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether `uri` is a file or a folder (a prefix holding objects, on S3)."""
    if not is_remote(uri):
        return os.path.exists(uri)
    return bool(filesystem_for(uri, storage_options).exists(uri))


def first_files(uri: str, wanted: Callable[[str], bool], storage_options: dict[str, Any] | None = None,
                limit: int = FIRST_FILES, budget: int = BUDGET) -> Look:
    """Up to `limit` files under `uri` (or `uri` itself, a file) whose path relative to `uri`
    `wanted` accepts, looking at no more than `budget` entries. Symbolically linked folders are
    not entered (the readers never follow them)."""
    if is_remote(uri):
        return _first_remote(uri, wanted, storage_options, limit, budget)
    return _first_local(uri, wanted, limit, budget)


def _first_local(uri: str, wanted: Callable[[str], bool], limit: int, budget: int) -> Look:
    look = Look()
    if os.path.isfile(uri):
        (look.matches if wanted(posixpath.basename(uri)) else look.others).append(uri)
        return look
    root = uri.rstrip("/") + "/"
    todo, seen = [uri], 0
    while todo:
        with os.scandir(todo.pop()) as entries:  # lazy: a folder of 100M files is not read whole
            for entry in entries:
                seen += 1
                if seen > budget or len(look.matches) >= limit:
                    look.exhaustive = False
                    return look
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                else:  # a file, a link, a FIFO: what the readers would meet (and refuse as samples)
                    (look.matches if wanted(entry.path.removeprefix(root)) else look.others).append(entry.path)
                    del look.others[OTHERS:]
    return look


def _first_remote(uri: str, wanted: Callable[[str], bool], storage_options: dict[str, Any] | None, limit: int,
                  budget: int) -> Look:
    """One recursive listing of at most `budget` keys (S3: list_objects_v2 without a delimiter,
    keys in lexicographic order), else a walk of fsspec listings stopped as early."""
    fs = filesystem_for(uri, storage_options)
    scheme = uri.split("://", 1)[0] + "://"
    look = Look()
    if fs.isfile(uri):
        (look.matches if wanted(posixpath.basename(uri)) else look.others).append(uri)
        return look
    root = uri.split("://", 1)[1].rstrip("/") + "/"
    names = _remote_names(fs, uri, budget)
    look.exhaustive = len(names) < budget
    for name in names:
        path = name.split("://", 1)[-1]
        relative = path.removeprefix(root)
        if wanted(relative):
            look.matches.append(scheme + path)
            if len(look.matches) >= limit:
                look.exhaustive = False
                break
        elif len(look.others) < OTHERS:
            look.others.append(scheme + path)
    return look


def _remote_names(fs: Any, uri: str, budget: int) -> list[str]:
    if hasattr(fs, "_lsdir") and type(fs).__name__ == "S3FileSystem":
        from fsspec.asyn import sync

        entries = sync(fs.loop, fs._lsdir, uri.split("://", 1)[1].rstrip("/"), max_items=budget, delimiter="")
        return [e["name"] for e in entries if e.get("type") != "directory"][:budget]
    names: list[str] = []
    for folder, _, files in fs.walk(uri):  # one listing per folder; stopped once the budget is spent
        names += [f"{folder}/{f}" for f in files]
        if len(names) >= budget:
            break
    return names[:budget]
