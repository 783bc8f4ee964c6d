"""The `sources.yaml` catalog: which source datasets feed the corpus, and how to read them.

Every later stage keys its partitions on `SourceSpec.name`, so validation is strict and each
error names the source and the field an operator has to fix.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prx_core.sources.catalog_fields import (
    JOIN_FORMATS,
    DownloadSettings,
    JoinSpec,
    column_field,
    names_field,
    parse_download,
    parse_joins,
    resolve_uri,
)
from prx_core.store.names import MERGED, NAME_PATTERN, validate_source_name

__all__ = ["FORMATS", "TABLE_FORMATS", "JOIN_FORMATS", "CatalogError", "Catalog", "SourceSpec", "JoinSpec",
           "DownloadSettings", "load_catalog", "parse_catalog", "dump_catalog", "validate_source_name"]

FORMATS = ("parquet", "imagefolder", "webdataset", "lance", "huggingface")
TABLE_FORMATS = ("parquet", "lance", "huggingface")  # rows of a table: columns name the image, caption, key...
_COLUMN_FIELDS = ("image_column", "url_column", "caption_column", "key_column", "embedding_column")
_LIMIT_FIELDS = ("max_image_bytes", "max_caption_bytes")
_FIELDS = ("name", "format", "uri", *_COLUMN_FIELDS, "metadata_columns", "joins", "download", "weight", *_LIMIT_FIELDS)
DEFAULT_MAX_IMAGE_BYTES = 64 << 20  # a bigger image or caption is a reject, checked before reading it
DEFAULT_MAX_CAPTION_BYTES = 64 << 10


class CatalogError(ValueError):
    """An invalid catalog; the message names the file, the source and the field."""


@dataclass(frozen=True)
class SourceSpec:
    """One source dataset; `name` is its Dagster partition key."""

    name: str
    format: str
    uri: str
    image_column: str | None = None
    caption_column: str | None = None
    key_column: str | None = None
    embedding_column: str | None = None
    weight: float = 1.0
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES
    url_column: str | None = None  # a metadata-only table: images fetched from this column's URLs
    metadata_columns: tuple[str, ...] = ()  # carried per sample into `samples.metadata`
    joins: tuple[JoinSpec, ...] = ()
    download: DownloadSettings = field(default_factory=DownloadSettings)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON values (lists, not tuples): what the catalog file and run manifests hold."""
        return _plain({**asdict(self), "download": self.download.to_dict()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SourceSpec:
        """The inverse of `to_dict` (a manifest's copy of the spec, read back on a worker)."""
        data = dict(data)
        data["metadata_columns"] = tuple(data.get("metadata_columns") or ())
        data["joins"] = tuple(JoinSpec(**{**j, "metadata_columns": tuple(j.get("metadata_columns") or ())})
                              for j in data.get("joins") or ())
        data["download"] = DownloadSettings(**(data.get("download") or {}))
        return cls(**data)

    @property
    def is_table(self) -> bool:
        return self.format in TABLE_FORMATS


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Catalog:
    """The parsed catalog, with relative URIs resolved against the catalog's folder."""

    path: str
    sources: tuple[SourceSpec, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def get(self, name: str) -> SourceSpec:
        for source in self.sources:
            if source.name == name:
                return source
        raise KeyError(f"no source named {name!r} in {self.path} (known: {', '.join(self.names)})")


def load_catalog(path: str | Path) -> Catalog:
    """Read and validate a catalog file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read catalog: {exc.strerror or exc}") from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    except RecursionError as exc:  # pyyaml recurses once per nesting level
        raise CatalogError(f"{path}: not valid YAML: nested too deeply") from exc
    return parse_catalog(document, base_dir=path.resolve().parent, origin=str(path))


def parse_catalog(document: Any, base_dir: Path, origin: str = "<catalog>") -> Catalog:
    """Validate a loaded YAML document; relative local URIs resolve against `base_dir`."""
    if not isinstance(document, dict) or "sources" not in document:
        raise CatalogError(f"{origin}: expected a mapping with a 'sources' list")
    unknown_top = set(document) - {"sources"}
    if unknown_top:
        raise CatalogError(f"{origin}: unknown top-level field(s): {', '.join(sorted(map(str, unknown_top)))}")
    entries = document["sources"]
    if not isinstance(entries, list) or not entries:
        raise CatalogError(f"{origin}: 'sources' must be a non-empty list")
    sources: list[SourceSpec] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        source = _parse_source(entry, index, base_dir, origin)
        if source.name in seen:
            raise CatalogError(f"{origin}: source {source.name!r}: field 'name': duplicate source name")
        seen.add(source.name)
        sources.append(source)
    return Catalog(path=origin, sources=tuple(sources))


def _parse_source(entry: Any, index: int, base_dir: Path, origin: str) -> SourceSpec:
    label = f"source #{index + 1}"
    if not isinstance(entry, dict):
        raise CatalogError(f"{origin}: {label}: expected a mapping, got {type(entry).__name__}")
    name = entry.get("name")
    if isinstance(name, str) and name:
        label = f"source {name!r}"

    def fail(field: str, problem: str) -> CatalogError:
        return CatalogError(f"{origin}: {label}: field '{field}': {problem}")

    unknown = set(entry) - set(_FIELDS)
    if unknown:
        raise fail(sorted(map(str, unknown))[0], f"unknown field (allowed: {', '.join(_FIELDS)})")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise fail("name", f"must match [a-z0-9_]+ (it is the partition key), got {name!r}")
    if name == MERGED:
        raise fail("name", f"{MERGED!r} is reserved: it holds the small streams merged across sources "
                           "(training.small_streams: merge); choose another name")
    fmt = entry.get("format")
    if fmt not in FORMATS:
        raise fail("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    uri = entry.get("uri")
    if not isinstance(uri, str) or not uri.strip():
        raise fail("uri", "required: a local path or an s3:// URI")
    columns: dict[str, str | None] = {}
    for name_ in _COLUMN_FIELDS:
        columns[name_] = column_field(entry, name_, fail)
    table = fmt in TABLE_FORMATS
    if table and columns["image_column"] and columns["url_column"]:
        raise fail("url_column", "give image_column (image bytes in the table) or url_column (images fetched "
                                 "from URLs), not both")
    if fmt in ("parquet", "lance") and not (columns["image_column"] or columns["url_column"]):
        raise fail("image_column", f"required for format {fmt} (or url_column for a table of image URLs)")
    if not table:
        for name_ in ("image_column", "url_column", "embedding_column"):
            if columns[name_]:
                raise fail(name_, f"not supported for format {fmt}")
    parts = (columns["caption_column"] or "txt").lower().split(".") if fmt == "webdataset" else ["txt"]
    if "" in parts or ("json" in parts and parts.index("json") == len(parts) - 1):  # see tars.caption_rule
        raise fail("caption_column", "a member extension (txt) or extension.field of a JSON member (json.caption), "
                                     f"got {columns['caption_column']!r}")
    metadata_columns = names_field(entry, "metadata_columns", fail)
    if metadata_columns and not table:
        raise fail("metadata_columns", f"not supported for format {fmt} (its metadata comes from its own files)")
    joins = parse_joins(entry.get("joins"), base_dir, fail)
    if joins and table and not columns["key_column"]:
        raise fail("key_column", "required with joins: joined tables are keyed like the source, and the default "
                                 "key (<file>:<row>) names no row of another table")
    download = parse_download(entry.get("download"), fail)
    if download != DownloadSettings() and not table:
        raise fail("download", "only for table sources (url_column, or an Image() column whose paths are URLs)")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise fail("weight", f"must be a positive number, got {weight!r}")
    limits = {f: getattr(SourceSpec, f) if entry.get(f) is None else entry[f] for f in _LIMIT_FIELDS}  # null: default
    for name_, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail(name_, f"must be a positive whole number of bytes, got {value!r}")
    return SourceSpec(
        name=name,
        format=fmt,
        uri=resolve_uri(uri.strip(), base_dir),
        weight=float(weight),
        metadata_columns=metadata_columns,
        joins=joins,
        download=download,
        **columns,
        **limits,
    )


def dump_catalog(sources: list[SourceSpec], path: str | Path) -> None:
    """Write a catalog file (the inverse of `load_catalog`, URIs as given)."""
    document = {"sources": [source.to_dict() for source in sources]}
    Path(path).write_text(yaml.safe_dump(document, sort_keys=False))
