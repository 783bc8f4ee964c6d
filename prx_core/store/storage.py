"""One URI-aware storage layer: local paths and `s3://` URIs through fsspec/s3fs.

Everything that touches the corpus root goes through `Storage`, so moving from a laptop folder
to `s3://bucket/prefix` is a configuration change, never a code change.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec

from prx_core.store import fencing
from prx_core.store.credentials import redact, refuse_literal_secrets, resolve_references

REMOTE_SCHEMES = ("s3://", "gs://", "az://", "abfs://", "memory://")
RUNS = "_runs"  # <root>/_runs/<asset>/<partition>/<attempt>/: work-unit attempts (prx_core.compute.units)
COMMITTED = "committed"  # the marker of an attempt whose outputs are live


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def join_uri(base: str, *parts: str) -> str:
    """Join path segments onto a local path or a URI without collapsing `s3://`."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.normpath(os.path.join(base, *parts))


def normalize_root(root: str) -> str:
    """A corpus root as every writer, reader and run records it: an absolute local path (`~`
    expanded), or the URI as given less a trailing slash. One rule, so two spellings of the same
    root name the same streams, manifests and Dagster home."""
    return root.rstrip("/") if is_remote(root) else os.path.abspath(os.path.expanduser(root))


def filesystem_for(uri: str, storage_options: dict[str, Any] | None = None) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem that serves `uri` (local files, or s3:// through s3fs). `{env: NAME}`
    references are resolved here, in the process that does the I/O; without credentials in the
    options, s3fs reads the standard AWS chain (env vars, profile, IAM role) itself."""
    if is_remote(uri):
        return fsspec.filesystem(uri.split("://", 1)[0], **resolve_references(storage_options or {}))
    return fsspec.filesystem("file")


class LanceOptions(dict):
    """pylance storage options as resolved in this process. Pickled (e.g. as a Ray task argument)
    as the unresolved s3fs options, so the receiving worker resolves `{env: NAME}` from its own
    environment and no secret value travels; its repr hides secrets."""

    def __init__(self, resolved: dict[str, str], source: dict[str, Any] | None) -> None:
        super().__init__(resolved)
        self.source = dict(source or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return lance_storage_options, (self.source,)

    def __repr__(self) -> str:
        return repr(redact(dict(self)))


def lance_storage_options(storage_options: dict[str, Any] | None) -> LanceOptions:
    """s3fs options as pylance (object_store) expects them, references resolved in this process.
    Without credentials in the options, Lance reads the standard AWS env vars itself."""
    opts = resolve_references(dict(storage_options or {}))
    client = opts.pop("client_kwargs", {}) or {}
    mapping = {
        "key": "aws_access_key_id",
        "secret": "aws_secret_access_key",
        "token": "aws_session_token",
        "endpoint_url": "aws_endpoint",
    }
    out = {mapping[k]: str(v) for k, v in opts.items() if k in mapping and v is not None}
    if "endpoint_url" in client:
        out["aws_endpoint"] = str(client["endpoint_url"])
    if "region_name" in client:
        out["aws_region"] = str(client["region_name"])
    if out.get("aws_endpoint", "").startswith("http://"):
        out["allow_http"] = "true"
    return LanceOptions(out, storage_options)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def is_no_space(exc: BaseException) -> bool:
    """An out-of-space error, as the OS (errno) or Lance (a message holding the OS error) reports it."""
    return isinstance(exc, OSError) and (exc.errno in _NO_SPACE or any(t in str(exc) for t in _NO_SPACE_TEXT))


@contextmanager
def naming_full_disk(uri: str) -> Iterator[None]:
    """Re-raise a full disk while writing `uri` as an OSError naming it: the OS reports ENOSPC on a
    write without the file, and Lance names only its own source line, so an operator could not
    tell which volume filled up."""
    try:
        yield
    except OSError as exc:
        if not is_no_space(exc) or f"writing {uri}" in str(exc):
            raise
        raise OSError(errno.ENOSPC, f"no space left on the device while writing {uri} (free space there or move "
                                    f"the corpus root; the previous version is intact): {exc}", uri) from exc


def put_atomic(fs: fsspec.AbstractFileSystem, uri: str, data: bytes) -> None:
    """Atomic for readers: temp file + rename locally, one PUT (all or nothing) remotely. A
    publication (an MDS index.json, a skip list): fenced by the partition locks held."""
    fencing.ensure_held()
    if is_remote(uri):
        fs.pipe_file(uri, data)
        return
    tmp = os.path.join(os.path.dirname(uri), f".{os.path.basename(uri)}.{uuid.uuid4().hex}.tmp")
    try:
        with naming_full_disk(uri):
            os.makedirs(os.path.dirname(uri), exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, uri)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclass(frozen=True)
class Storage:
    """A corpus root (local folder or object-store prefix) plus its connection options.

    `storage_options` are s3fs keyword arguments (`endpoint_url`, `client_kwargs`, ...);
    `lance_storage_options()` translates them for pylance. A Storage is pickled into Ray tasks, so
    it holds no secret: a literal key/secret/token is refused (`SecretInConfigError`); credentials
    come from each process's environment (the AWS chain, or `{env: NAME}` references resolved
    when the filesystem is built; see prx_core.store.credentials).
    """

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        refuse_literal_secrets(self.storage_options, f"storage_options of {self.root}")
        if not is_remote(self.root):
            object.__setattr__(self, "root", os.path.abspath(os.path.expanduser(self.root)))

    @property
    def is_remote(self) -> bool:
        return is_remote(self.root)

    def uri(self, *parts: str) -> str:
        return join_uri(self.root, *parts)

    def lance_uri(self, table: str) -> str:
        return self.uri("lance", f"{table}.lance")

    def filesystem(self) -> fsspec.AbstractFileSystem:
        return filesystem_for(self.root, self.storage_options)

    def lance_storage_options(self) -> LanceOptions:
        return lance_storage_options(self.storage_options)

    def check_writable(self) -> tuple[bool, str]:
        """Write, read back and delete a probe object under the root."""
        fs = self.filesystem()
        probe = self.uri(f".prx-write-probe-{uuid.uuid4().hex}")
        payload = b"prx-corpus write probe"
        try:
            if not self.is_remote:
                os.makedirs(self.root, exist_ok=True)
            with fs.open(probe, "wb") as handle:
                handle.write(payload)
            with fs.open(probe, "rb") as handle:
                if handle.read() != payload:
                    return False, f"{self.root}: probe read back differently"
            fs.rm(probe)
        except Exception as exc:  # any backend error means "not writable", reported, not raised
            return False, f"{self.root}: {type(exc).__name__}: {exc}"
        return True, f"{self.root} is writable"
