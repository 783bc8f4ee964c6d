"""Image folders: image files with sidecar `<stem>.txt` captions, one fragment per folder.

Captions and metadata also come from HF `imagefolder` metadata files (`metadata.jsonl` /
`metadata.csv` in the folder or an ancestor), and a class folder's name is a `label`
(`prx_core.sources.folders.captions` says which wins); metadata files are never samples.

A folder source never reads outside its root: symbolic links (files or directories) and
non-regular files (FIFOs, devices) are never opened; each becomes a reject with a reason, so a
caption linked to `/proc/self/environ` cannot become a caption. Local files are opened with
`O_NOFOLLOW` and checked with `fstat`, so a file swapped for a link after the listing is refused
too. Keys are unique by construction (`folder_leaf_keys`).
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders.captions import FolderCaptions
from prx_core.sources.records import (
    BAD_NAME,
    CAPTION_EXTENSIONS,
    CAPTION_TOO_LARGE,
    IMAGE_EXTENSIONS,
    IMAGE_TOO_LARGE,
    NOT_REGULAR_FILE,
    SYMLINK,
    UNREADABLE_FILE,
    Batches,
    decode_caption,
    is_utf8,
    printable_name,
    record,
    refused,
)
from prx_core.store.storage import filesystem_for, is_remote

Refusal = tuple[str, str]
REMOTE_READS = 16  # files of a remote folder read at once by one unit


def extension(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def folder_leaf_keys(names: Iterable[str]) -> dict[str, str]:
    """The key of every image file among one folder's file `names`: its stem (`x.jpg` -> `x`, what
    keys have always been), or its full name when the stem is ambiguous: another image shares it
    (`x.jpg` and `x.png` -> `x.jpg`, `x.png`) or an image is named exactly that (`x.jpg.png` next
    to `x.jpg`). Unique: full names are distinct, a kept stem belongs to one image and is no
    image's full name. A key therefore depends only on its own folder's listing."""
    images = sorted({n for n in names if extension(n) in IMAGE_EXTENSIONS})
    stems = Counter(posixpath.splitext(n)[0] for n in images)
    full = set(images)
    keys = {}
    for name in images:
        stem = posixpath.splitext(name)[0]
        keys[name] = stem if stems[stem] == 1 and stem not in full else name
    return keys


def read_folder(spec: SourceSpec, folder: str, storage_options: dict[str, Any] | None,
                names: tuple[str | None, str | None] | None = None) -> Iterator[pa.RecordBatch]:
    """Image files of one folder with sidecar `<stem>.txt` (or `.caption`) captions; key = the
    folder's path relative to the source root, then `folder_leaf_keys`. With `names` (lo, hi),
    only the image files named from `lo` up to `hi` (excluded; None: open), a `samples` unit's
    part of a big folder: keys and captions still come from the whole listing."""
    fs = filesystem_for(spec.uri, storage_options)
    remote = is_remote(spec.uri)
    rel = relative_folder(spec.uri, folder)
    batches = Batches()
    if not remote and outside_root(spec.uri, folder):
        yield from batches.add(refused(printable_name(rel or "."), SYMLINK, f"folder {printable_name(rel)!r} is a "
                                       "symbolic link or resolves outside the source root: not followed"))
        yield from batches.flush()
        return
    entries = {posixpath.basename(e["name"].rstrip("/")): e for e in fs.ls(folder, detail=True)
               if not (e["type"] == "directory" and not e.get("islink"))}
    fs.invalidate_cache(folder)  # a worker's s3fs would keep every folder it ever read
    keys = folder_leaf_keys(entries)
    captions = FolderCaptions(fs, remote, spec.uri, spec.caption_column, rel, entries, set(keys))
    lo, hi = names or (None, None)
    wanted = [(name, leaf) for name, leaf in keys.items()
              if (lo is None or name >= lo) and (hi is None or name < hi)]

    def read_one(item: tuple[str, str]) -> dict[str, Any]:
        name, leaf = item
        key = posixpath.join(rel, leaf) if rel else leaf
        if not is_utf8(key):
            return refused(printable_name(key), BAD_NAME, "file or folder name is not UTF-8")
        return read_sample(fs, remote, spec, key, entries, name, captions)

    for row in in_order(read_one, wanted, REMOTE_READS if remote else 1):
        yield from batches.add(row)
    yield from batches.flush()


def in_order(read: Callable[[Any], dict[str, Any]], items: list[Any], threads: int) -> Iterator[dict[str, Any]]:
    """`read` of each item, in order; with `threads` > 1, that many at once (an object store's
    GETs wait on the network: one after another, a folder of 100k files is hours), holding at
    most `threads` results: bounded by `threads` x the source's `max_image_bytes`."""
    if threads <= 1:
        yield from map(read, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, "prx-folder-read") as pool:
        for at in range(0, len(items), threads):
            yield from pool.map(read, items[at:at + threads])


def read_sample(fs: Any, remote: bool, spec: SourceSpec, key: str, entries: dict[str, dict[str, Any]],
                name: str, captions: FolderCaptions) -> dict[str, Any]:
    """One image with its caption (sidecar, else metadata row) and metadata, or a refusal naming
    the file that was refused."""
    stem = posixpath.splitext(name)[0]
    sidecar = next((entries[f"{stem}.{e}"] for e in CAPTION_EXTENSIONS if f"{stem}.{e}" in entries), None)
    caption = None
    if sidecar is not None:
        text = read_file(fs, remote, sidecar, spec.max_caption_bytes, CAPTION_TOO_LARGE)
        if isinstance(text, tuple):
            return refused(key, *text)
        caption = decode_caption(text)
    image = read_file(fs, remote, entries[name], spec.max_image_bytes, IMAGE_TOO_LARGE)
    if isinstance(image, tuple):
        return refused(key, *image)
    caption, metadata = captions.describe(name, caption)
    return record(key, image, caption, metadata=metadata)


def read_file(fs: Any, remote: bool, entry: dict[str, Any], limit: int, too_large: str) -> bytes | Refusal:
    """The bytes of a listed file, or (reason, message): never through a link, never a FIFO or a
    device, never more than `limit` bytes."""
    path, base = entry["name"], printable_name(posixpath.basename(entry["name"]))
    if entry.get("islink"):
        return SYMLINK, f"{base} is a symbolic link: folder sources never follow links"
    if entry["type"] != "file":
        return NOT_REGULAR_FILE, f"{base} is not a regular file ({entry['type']})"
    if int(entry.get("size") or 0) > limit:
        return too_large, f"{base} has {entry['size']} bytes, over the source's limit of {limit}"
    if remote:  # a ranged read: an object replaced by a bigger one after the listing stays bounded
        return read_bounded(lambda: fs.cat_file(path, start=0, end=limit + 1) if int(entry.get("size") or 0) else b"",
                            limit, base, too_large)
    return read_bounded(lambda: read_local(path, limit + 1), limit, base, too_large)


def read_bounded(read: Callable[[], bytes | Refusal], limit: int, name: str, too_large: str) -> bytes | Refusal:
    """What `read` gives (at most `limit` + 1 bytes), or (reason, message) naming `name`: a link met
    on the way, an unreadable file, or more than `limit` bytes."""
    try:
        data = read()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return SYMLINK, f"{name} is a symbolic link: sources never follow links"
        return UNREADABLE_FILE, f"{name}: {type(exc).__name__}: {exc.strerror or exc}"
    if isinstance(data, tuple):
        return data
    if len(data) > limit:
        return too_large, f"{name} has more than {limit} bytes, the source's limit"
    return data


def read_local(path: str, most: int) -> bytes | Refusal:
    """Up to `most` bytes of a local regular file, opened without following a link (O_NOFOLLOW) and
    without blocking on a FIFO, then checked with fstat: a file swapped after the listing is refused."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return NOT_REGULAR_FILE, f"{printable_name(posixpath.basename(path))} is not a regular file"
        chunks, left = [], most
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def relative_folder(uri: str, folder: str) -> str:
    """`folder` relative to the source root ('' for the root itself); a folder that is not under
    the root (a fragment id like `<root>/../x`) is an error, never a read."""
    root = posixpath.normpath(uri.split("://", 1)[-1])
    path = posixpath.normpath(folder.split("://", 1)[-1])
    if path == root:
        return ""
    if not path.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"folder {folder!r} is not under the source root {uri!r}")
    return path[len(root.rstrip("/")) + 1:]


def outside_root(uri: str, folder: str) -> bool:
    """A local folder that is a link, or resolves (through a linked parent) outside the root. The
    root itself may be a link: it is the operator's choice, made in the catalog."""
    if os.path.normpath(folder) == os.path.normpath(uri):
        return False
    root, path = os.path.realpath(uri), os.path.realpath(folder)
    return os.path.islink(folder) or (path != root and not path.startswith(root.rstrip(os.sep) + os.sep))
