"""One URI-aware storage layer: local paths and `s3://` URIs through fsspec/s3fs.

Everything that touches the corpus root goes through `Storage`, so moving from a laptop folder
to `s3://bucket/prefix` is a configuration change, never a code change.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec

REMOTE_SCHEMES = ("s3://", "gs://", "az://", "abfs://", "memory://")


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def join_uri(base: str, *parts: str) -> str:
    """Join path segments onto a local path or a URI without collapsing `s3://`."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.normpath(os.path.join(base, *parts))


def filesystem_for(uri: str, storage_options: dict[str, Any] | None = None) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem that serves `uri` (local files, or s3:// through s3fs)."""
    if is_remote(uri):
        return fsspec.filesystem(uri.split("://", 1)[0], **(storage_options or {}))
    return fsspec.filesystem("file")


def lance_storage_options(storage_options: dict[str, Any] | None) -> dict[str, str]:
    """s3fs options as pylance (object_store) expects them."""
    opts = dict(storage_options or {})
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
    return out


def put_atomic(fs: fsspec.AbstractFileSystem, uri: str, data: bytes) -> None:
    """Atomic for readers: temp file + rename locally, one PUT (all or nothing) remotely."""
    if is_remote(uri):
        fs.pipe_file(uri, data)
        return
    os.makedirs(os.path.dirname(uri), exist_ok=True)
    tmp = os.path.join(os.path.dirname(uri), f".{os.path.basename(uri)}.{uuid.uuid4().hex}.tmp")
    try:
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

    `storage_options` are s3fs keyword arguments (`key`, `secret`, `endpoint_url`, ...);
    `lance_storage_options()` translates them for pylance.
    """

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
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

    def lance_storage_options(self) -> dict[str, str]:
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
