"""The catalog's nested fields: joined tables, download settings, and the small parsers for the
column and list fields every source entry shares (`prx_core.sources.catalog` uses them; each error
names the field as `catalog.CatalogError` messages do)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from prx_core.store.storage import is_remote, join_uri

JOIN_FORMATS = ("parquet", "lance")
_JOIN_FIELDS = ("uri", "format", "key_column", "caption_column", "embedding_column", "metadata_columns")


@dataclass(frozen=True)
class JoinSpec:
    """A table keyed like its source (captions, CLIP vectors, metadata kept apart from the images),
    joined on the workers by each unit's own keys (`prx_core.sources.joins`)."""

    uri: str
    key_column: str
    format: str = "parquet"  # parquet | lance (default: lance when the uri ends in .lance)
    caption_column: str | None = None
    embedding_column: str | None = None
    metadata_columns: tuple[str, ...] = ()


@dataclass(frozen=True)
class DownloadSettings:
    """How a metadata-only source's images are fetched (`url_column`), per ingest worker."""

    concurrency: int = 16  # requests in flight per worker
    per_host: int = 4  # of those, to one host at a time
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0  # the longest silence while waiting for the response or its body
    attempt_timeout_s: float = 120.0  # one attempt in all, redirects included (a body dripping slowly)
    retries: int = 3  # further attempts after a 429, a 5xx or a dropped connection, with backoff
    backoff_s: float = 1.0  # the first retry's wait; doubled at each further one
    retry_after_max_s: float = 30.0  # a longer Retry-After is not waited for: the row is a download_error
    max_redirects: int = 5  # redirects followed (http and https targets only)
    honor_opt_out: bool = True  # X-Robots-Tag noai, noimageai, noindex, noimageindex or none refuse the image
    user_agent: str = "prx-corpus/0.1 (text-to-image corpus builder; honours X-Robots-Tag noai)"
    url_deadline_s: float = 180.0  # one URL in all: every attempt, redirect and backoff wait
    retry_within_s: float = 10.0  # a dropped attempt is retried only when it dropped this soon (not after a long drip)
    window_rows: int = 8192  # rows read ahead of the oldest row still fetching: a sliding window, no barrier per batch
    window_bytes: int = 512 << 20  # fetched bytes held by the window; no new fetch starts while over it
    # what a source may reach (prx_core.sources.fetch.policy): by default public http(s) hosts and its own objects
    allow_networks: tuple[str, ...] = ()  # non-public networks it may reach ("10.0.0.0/8", "127.0.0.1/32"); "*": any
    allow_files: bool = False  # file:// URLs and absolute local paths
    allow_object_prefixes: tuple[str, ...] = ()  # object-store URL prefixes beyond the source's uri; "*": any
    opt_out_agents: tuple[str, ...] = ("img2dataset",)  # X-Robots-Tag scoped to these agents counts, as to ours

    # Added after the first release: left out of a spec's dict while at their default, so an upgrade
    # changes no `samples` manifest (a committed source is still reused, not re-ingested).
    ADDED: ClassVar[tuple[str, ...]] = ("url_deadline_s", "retry_within_s", "window_rows", "window_bytes",
                                        "allow_networks", "allow_files", "allow_object_prefixes", "opt_out_agents")
    LISTS: ClassVar[tuple[str, ...]] = ("allow_networks", "allow_object_prefixes", "opt_out_agents")

    def __post_init__(self) -> None:
        for name in self.LISTS:  # a manifest's copy holds lists: compare and hash as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        data, default = asdict(self), DownloadSettings()
        return {k: v for k, v in data.items() if k not in self.ADDED or v != getattr(default, k)}


def column_field(entry: dict[str, Any], name: str, fail: Any) -> str | None:
    value = entry.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise fail(name, f"must be a column name or null, got {value!r}")
    return value


def names_field(entry: dict[str, Any], name: str, fail: Any) -> tuple[str, ...]:
    value = entry.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise fail(name, f"must be a list of column names, got {value!r}")
    if len(set(value)) != len(value):
        raise fail(name, f"names a column twice: {value!r}")
    return tuple(value)


def parse_joins(value: Any, base_dir: Path, fail: Any) -> tuple[JoinSpec, ...]:
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise fail("joins", f"must be a list of tables ({{uri, key_column, caption_column, ...}}), got {value!r}")
    joins = []
    for index, join in enumerate(value):
        where = f"joins[{index}]"
        if not isinstance(join, dict):
            raise fail(where, f"expected a mapping, got {type(join).__name__}")
        unknown = set(join) - set(_JOIN_FIELDS)
        if unknown:
            raise fail(f"{where}.{sorted(map(str, unknown))[0]}", f"unknown field (allowed: {', '.join(_JOIN_FIELDS)})")
        uri = join.get("uri")
        if not isinstance(uri, str) or not uri.strip():
            raise fail(f"{where}.uri", "required: a local path or an s3:// URI")
        fmt = join.get("format") or ("lance" if uri.rstrip("/").endswith(".lance") else "parquet")
        if fmt not in JOIN_FORMATS:
            raise fail(f"{where}.format", f"must be one of {', '.join(JOIN_FORMATS)}, got {fmt!r}")
        cols = {f: column_field(join, f, lambda f_, p: fail(f"{where}.{f_}", p))
                for f in ("key_column", "caption_column", "embedding_column")}
        if not cols["key_column"]:
            raise fail(f"{where}.key_column", "required: the column holding the source's keys")
        metadata = names_field(join, "metadata_columns", lambda f_, p: fail(f"{where}.{f_}", p))
        if not (cols["caption_column"] or cols["embedding_column"] or metadata):
            raise fail(where, "joins nothing: give caption_column, embedding_column or metadata_columns")
        joins.append(JoinSpec(uri=resolve_uri(uri.strip(), base_dir), format=fmt, metadata_columns=metadata, **cols))
    return tuple(joins)


def parse_download(value: Any, fail: Any) -> DownloadSettings:
    if value is None:
        return DownloadSettings()
    if not isinstance(value, dict):
        raise fail("download", f"must be a mapping of settings, got {value!r}")
    known = {f.name: f for f in fields(DownloadSettings)}
    settings: dict[str, Any] = {}
    for key, item in value.items():
        if key not in known:
            raise fail(f"download.{key}", f"unknown setting (allowed: {', '.join(known)})")
        default = known[key].default
        if key in DownloadSettings.LISTS:
            if not isinstance(item, list) or not all(isinstance(v, str) and v.strip() for v in item):
                raise fail(f"download.{key}", f"must be a list of names or prefixes, got {item!r}")
            settings[key] = tuple(v.strip() for v in item)
            bad = [v for v in settings[key] if key == "allow_networks" and v != "*" and not _is_network(v)]
            if bad:
                raise fail(f"download.{key}", f"must be networks like 10.0.0.0/8 or \"*\", got {bad[0]!r}")
            continue
        if isinstance(default, bool):
            ok = isinstance(item, bool)
        elif isinstance(default, str):
            ok = isinstance(item, str) and bool(item.strip())
        else:
            ok = (not isinstance(item, bool) and isinstance(item, (int, float)) and math.isfinite(item) and item >= 0
                  and (item > 0 or key in ("retries", "backoff_s", "max_redirects")) and (isinstance(item, int) or isinstance(default, float)))
        if not ok:
            raise fail(f"download.{key}", f"must be like {default!r}, got {item!r}")
        settings[key] = float(item) if isinstance(default, float) else item
    return DownloadSettings(**settings)


def _is_network(value: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return False
    return True


def resolve_uri(uri: str, base_dir: Path) -> str:
    if is_remote(uri) or Path(uri).is_absolute():
        return uri
    return join_uri(str(base_dir), uri)
