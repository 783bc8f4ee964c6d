"""The folders of unit attempts (`<root>/_runs/<asset>/<partition>/<digest>/`): listing them and
removing an abandoned one with its uncommitted outputs (prx_core.compute.units)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prx_core.store.storage import COMMITTED


def join_path(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def stem(path: str) -> str:
    """A record's unit id: its file name without `.json`."""
    return path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")


def list_children(fs: Any, folder: str) -> list[str]:
    """The folder's entries, sorted; none when it does not exist (listings read afresh: s3fs caches)."""
    fs.invalidate_cache()
    if not fs.exists(folder):
        return []
    return sorted(fs.ls(folder, detail=False))


def discard_attempt(fs: Any, attempt: str) -> None:
    """Remove an abandoned attempt folder and its uncommitted outputs (a takedown's purge: only
    with the attempt's partition lock held, so that no run is using it)."""
    discard(fs, attempt)


def discard(fs: Any, attempt: str, spare: Callable[[str], bool] | None = None) -> None:
    """Remove an abandoned attempt: its uncommitted outputs (listed by its records) but those
    `spare` keeps (a chunk a published index names: its reader may still fetch it, and retention
    removes it a retention after an index drops it), then itself. A committed attempt's outputs
    are live: only its folder goes."""
    if not fs.exists(join_path(attempt, COMMITTED)):
        for path in list_children(fs, join_path(attempt, "done")):
            try:
                outputs = json.loads(fs.cat_file(path)).get("outputs", [])
            except (ValueError, OSError):
                continue
            for uri in outputs:
                if fs.exists(uri) and not (spare is not None and spare(uri)):
                    fs.rm(uri, recursive=True)
    fs.rm(attempt, recursive=True)
