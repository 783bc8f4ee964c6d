"""Walking an image folder of 100M files without holding its listing.

A sequential walk costs one listing round trip per folder (~200k for 100M files on S3, hours) and a
whole-tree `find` holds an info dict per file (~100 GB). Here the tree is listed level by level,
each level's folders in batches that run in parallel (Ray tasks when a cluster is up, so the
listing's CPU is spread too; threads otherwise, as in the `raw_source` observation), and each
folder is reduced where it was listed to one `FolderEntry`: the caller holds one small record per
folder, never one per file. The same records give the readers' fragments (`list_folders`) and the
observation's fingerprint (`observe_folders`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prx_core.compute.parallel import chunk, imap_tasks, on_cluster
from prx_core.sources.folders.reader import extension
from prx_core.sources.records import CAPTION_EXTENSIONS, IMAGE_EXTENSIONS, printable_name
from prx_core.store.storage import filesystem_for, is_remote

WALK_BATCH = 64  # folders listed per task: one task's memory is this many folders' entries
WALK_THREADS = 16  # listings in flight without a Ray cluster (listing waits on storage, not CPU)
WALK_CPUS = 0.25  # a Ray listing task's CPU share: it waits on storage most of the time


@dataclass(frozen=True)
class FolderEntry:
    """One listed folder, reduced: what planning and the fingerprint need of it."""

    folder: str  # full path or URI
    image_bytes: int  # bytes of its image files (each at least 1), 0 when it holds none
    files: int  # files of any kind directly in it
    bytes: int  # their bytes
    digest: str  # of its files' names and sizes: changes when any of them does
    link: bool = False  # a symbolically linked directory, not walked: a fragment of its own (one reject)
    image_files: int = 0  # its image files: the source's records (raw_source's row count)
    cuts: tuple[str, ...] = ()  # every `cut_every`-th image file's name (sorted): where `samples` may cut it


def walk_folders(uri: str, storage_options: dict[str, Any] | None, batch: int = WALK_BATCH,
                 threads: int = WALK_THREADS, cut_every: int = 0) -> list[FolderEntry]:
    """Every folder under `uri` (itself included), sorted by path; with `cut_every`, each folder
    of more image files names every `cut_every`-th of them (`FolderEntry.cuts`)."""
    out: list[FolderEntry] = []
    level = [uri]
    while level:
        below: list[str] = []
        for entries, subfolders in list_level(uri, storage_options, chunk(level, batch), threads, cut_every):
            out.extend(entries)
            below.extend(subfolders)
        level = sorted(below)
    return sorted(out, key=lambda e: e.folder)


def list_level(uri: str, storage_options: dict[str, Any] | None, batches: list[list[str]],
               threads: int, cut_every: int = 0) -> Iterator[tuple[list[FolderEntry], list[str]]]:
    """`list_batch` over `batches`, on the Ray cluster when one is up, else on threads."""
    if on_cluster() and len(batches) > 1:
        calls = [(uri, storage_options, folders, cut_every) for folders in batches]
        for _, result in imap_tasks(list_batch, calls, num_cpus=WALK_CPUS):
            yield result
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(batches)))) as pool:
        yield from pool.map(lambda folders: list_batch(uri, storage_options, folders, cut_every), batches)


def list_batch(uri: str, storage_options: dict[str, Any] | None, folders: list[str],
               cut_every: int = 0) -> tuple[list[FolderEntry], list[str]]:
    """List `folders` (a worker's share of one level): their entries, and the folders below them."""
    fs = filesystem_for(uri, storage_options)
    prefix = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
    entries: list[FolderEntry] = []
    below: list[str] = []
    for folder in folders:
        entry, subfolders, links = list_one(fs, prefix, folder, cut_every)
        entries.append(entry)
        entries.extend(links)
        below.extend(subfolders)
    return entries, below


def list_one(fs: Any, prefix: str, folder: str,
             cut_every: int = 0) -> tuple[FolderEntry, list[str], list[FolderEntry]]:
    """One folder's listing reduced to its entry, its subfolders and its linked directories."""
    digest = hashlib.sha256()
    images = files = size = count = 0
    cuts: list[str] = []
    subfolders: list[str] = []
    links: list[FolderEntry] = []
    listing = fs.ls(folder, detail=True)
    fs.invalidate_cache(folder)  # s3fs keeps every listing otherwise: 100M info dicts in the end
    for info in sorted(listing, key=lambda i: i["name"]):
        name = prefix + info["name"] if prefix and not info["name"].startswith(prefix) else info["name"]
        is_image = extension(name) in IMAGE_EXTENSIONS
        if info.get("islink") and not is_image and extension(name) not in CAPTION_EXTENSIONS:
            if not prefix and os.path.isdir(name):  # a stat, nothing under it is read
                links.append(FolderEntry(name, 1, 0, 0, "link", link=True, image_files=1))
                continue
        if info["type"] == "directory" and not info.get("islink"):
            subfolders.append(name)
            continue
        bytes_ = int(info.get("size") or 0)
        files, size = files + 1, size + bytes_
        images += (bytes_ or 1) if is_image else 0
        if is_image and cut_every and count and count % cut_every == 0:
            cuts.append(name.rsplit("/", 1)[-1])
        count += is_image
        digest.update(printable_name(f"{name.rsplit('/', 1)[-1]}\t{bytes_}\n").encode())
    entry = FolderEntry(folder, images, files, size, digest.hexdigest()[:16], image_files=count, cuts=tuple(cuts))
    return entry, subfolders, links


def fragments_of(entries: list[FolderEntry]) -> list[tuple[str, int]]:
    """The readers' fragments of an image folder: (folder, bytes of its images) for every folder
    holding image files, and each symbolically linked directory as a fragment of its own, which
    reads as one `symlink` reject (the loss stays visible)."""
    return [(e.folder, e.image_bytes) for e in entries if e.image_bytes]


def list_folders(uri: str, storage_options: dict[str, Any] | None = None) -> list[tuple[str, int]]:
    return fragments_of(walk_folders(uri, storage_options))


def fingerprint_lines(entries: list[FolderEntry]) -> list[str]:
    """One line per folder for the observation's fingerprint: any file added, removed, renamed or
    resized changes its folder's digest."""
    return [printable_name(f"{e.folder}\t{e.digest}") for e in entries]
