"""Joins of a source's records with tables keyed like it (captions, CLIP vectors, metadata kept
apart from the images), done by the ingest worker for its own keys.

Every joined table is first staged (`prx_core.stages.samples.join_tables`) as a Lance table of one shape,
`STAGED_SCHEMA`, with a BTREE index on `key`; a `Joiner` then looks up each record batch's keys in
IN-lists the index answers, so no joined table is loaded whole and no unit scans one. The join is
applied in one place, to every reader's `RECORD_SCHEMA` batches in the `samples` unit (tables, tar
shards, image folders alike), before `ingest_batch`. Its rules:

- a key missing on the joined side leaves that field empty (no caption, embedding or metadata);
- a key repeated on the joined side: the first row in the table's order (files in name order, or
  Lance fragments in id order, then rows in file order) is used; each later one is a
  `duplicate_key` reject (stage `samples`, key `<key>#join<j>.<n>`, j the join's index in the
  catalog, n = 1, 2, ...) naming the table, and the source row is kept;
- the source's own caption (or embedding) wins; among joins, the first that gives one wins; a
  blank caption counts as none. A joined caption over the source's `max_caption_bytes` refuses
  the sample (`caption_too_large`), as a caption of the source's own would;
- metadata: the joined `metadata_columns` are added to the record's metadata; a name the record
  already holds keeps its value (the source's own, then earlier joins win).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.sources.catalog import JoinSpec, SourceSpec
from prx_core.sources.records import CAPTION_TOO_LARGE, DUPLICATE_KEY, RECORD_SCHEMA, refused
from prx_core.store import lance_io
from prx_core.store.lookups import LOOKUP_BATCH, lookup_literals

STAGED_SCHEMA = pa.schema([
    pa.field("key", pa.string(), nullable=False),  # the joined table's key column, as text (source keys are)
    pa.field("file", pa.int32()),  # position of the row's file (or Lance fragment) in the table's listing
    pa.field("row", pa.int64()),  # the row's number in that file: (file, row) is the table's order
    pa.field("caption", pa.string()),
    pa.field("embedding", pa.list_(pa.float32())),
    pa.field("metadata", pa.map_(pa.string(), pa.string())),
])
TABLE_KEY, FILES_KEY = b"prx:table", b"prx:files"  # the staged table's schema metadata: the joined URI, its files


def staged_schema(table: str, files: Sequence[str]) -> pa.Schema:
    """`STAGED_SCHEMA` naming the joined table and its files (what a reject message names)."""
    return STAGED_SCHEMA.with_metadata({TABLE_KEY: table.encode(), FILES_KEY: json.dumps(list(files)).encode()})


@dataclass
class _Found:
    """One joined row: what it gives, and where it sits in the joined table."""

    file: int
    row: int
    caption: str | None
    embedding: list[float] | None
    metadata: list[tuple[str, str]] | None


class StagedTable:
    """A staged joined table, opened once per unit; `find` answers one batch of keys."""

    def __init__(self, index: int, join: JoinSpec, uri: str, storage_options: dict[str, str] | None) -> None:
        self.index, self.join = index, join
        self.dataset = lance_io.require_table(uri, storage_options)
        meta = self.dataset.schema.metadata or {}
        self.table = meta.get(TABLE_KEY, join.uri.encode()).decode()
        self.files: list[str] = json.loads(meta.get(FILES_KEY, b"[]"))
        self.columns = ["key", "file", "row"] + [name for name, wanted in (
            ("caption", join.caption_column), ("embedding", join.embedding_column),
            ("metadata", join.metadata_columns)) if wanted]

    def find(self, keys: Sequence[str]) -> tuple[dict[str, _Found], list[tuple[str, int, _Found, _Found]]]:
        """key -> its first row, and every later row of a repeated key as (key, n, row, first)."""
        literals = [lance_io.sql_literal(k) for k in keys]
        rows = lookup_literals(self.dataset, "key", literals, self.columns, batch=LOOKUP_BATCH)
        rows = rows.take(pc.sort_indices(rows, [("key", "ascending"), ("file", "ascending"), ("row", "ascending")]))
        first: dict[str, _Found] = {}
        seen: dict[str, int] = {}
        repeats: list[tuple[str, int, _Found, _Found]] = []
        data = {name: rows[name].to_pylist() for name in self.columns}
        for i, key in enumerate(data["key"]):
            found = _Found(data["file"][i], data["row"][i], data.get("caption", [None] * len(rows))[i],
                           data.get("embedding", [None] * len(rows))[i], data.get("metadata", [None] * len(rows))[i])
            if key not in first:
                first[key], seen[key] = found, 0
            else:
                seen[key] += 1
                repeats.append((key, seen[key], found, first[key]))
        return first, repeats

    def where(self, found: _Found) -> str:
        name = self.files[found.file] if 0 <= found.file < len(self.files) else f"file #{found.file}"
        return f"{name} row {found.row}"


class Joiner:
    """The staged tables of a source's joins, opened for one unit; `join` fills a record batch.

    `staged` holds one staged table URI per `spec.joins` entry, in catalog order (what
    `prx_core.stages.samples.join_tables.stage_joins` returned on the driver)."""

    def __init__(self, spec: SourceSpec, staged: Sequence[str], storage_options: dict[str, str] | None = None) -> None:
        if len(staged) != len(spec.joins):
            raise ValueError(f"source {spec.name!r}: {len(spec.joins)} joins but {len(staged)} staged tables")
        self.spec = spec
        self.tables = [StagedTable(j, join, uri, storage_options)
                       for j, (join, uri) in enumerate(zip(spec.joins, staged))]

    def __enter__(self) -> Joiner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tables = []

    def join(self, batch: pa.RecordBatch) -> pa.RecordBatch | pa.Table:
        """`batch` (RECORD_SCHEMA) with its live records' joined fields filled, plus one reject
        record per repeated joined row; the image column is passed through untouched."""
        keys = batch.column("source_key").to_pylist()
        reasons = batch.column("reject_reason").to_pylist()
        live = [i for i, (k, r) in enumerate(zip(keys, reasons))
                if r is None and k is not None and "\x00" not in k]  # a key with a NUL is no SQL literal: none joined
        if not self.tables or not live:
            return batch
        captions = batch.column("caption").to_pylist()
        embeddings = batch.column("embedding").to_pylist()
        metadata = [dict(m) if m else {} for m in batch.column("metadata").to_pylist()]
        messages = batch.column("reject_message").to_pylist()
        extra: list[dict[str, Any]] = []
        wanted = sorted({keys[i] for i in live})
        for table in self.tables:
            first, repeats = table.find(wanted)
            extra += [self._repeat(table, key, n, row, kept) for key, n, row, kept in repeats]
            for i in live:
                found = first.get(keys[i])
                if found is None:
                    continue
                if (captions[i] is None or not captions[i].strip()) and found.caption is not None:
                    captions[i] = found.caption
                    size = len(found.caption.encode("utf-8", "surrogatepass"))
                    if size > self.spec.max_caption_bytes and reasons[i] is None:
                        reasons[i] = CAPTION_TOO_LARGE
                        messages[i] = (f"joined caption of {size} bytes from {table.table} ({table.where(found)}), "
                                       f"over the limit {self.spec.max_caption_bytes}")
                if embeddings[i] is None and found.embedding is not None:
                    embeddings[i] = found.embedding
                for name, value in found.metadata or ():
                    metadata[i].setdefault(name, value)
        columns = {name: batch.column(name) for name in RECORD_SCHEMA.names}
        columns.update(caption=pa.array(captions, pa.string()), reject_reason=pa.array(reasons, pa.string()),
                       reject_message=pa.array(messages, pa.string()),
                       embedding=pa.array(embeddings, pa.list_(pa.float32())),
                       metadata=pa.array([list(m.items()) or None for m in metadata],
                                         pa.map_(pa.string(), pa.string())))
        joined = pa.RecordBatch.from_arrays([columns[n] for n in RECORD_SCHEMA.names], schema=RECORD_SCHEMA)
        if not extra:
            return joined
        return pa.Table.from_batches([joined, pa.RecordBatch.from_pylist(extra, schema=RECORD_SCHEMA)])

    def _repeat(self, table: StagedTable, key: str, n: int, row: _Found, kept: _Found) -> dict[str, Any]:
        return refused(f"{key}#join{table.index}.{n}", DUPLICATE_KEY,
                       f"key {key!r} repeated in joined table {table.table} (joins[{table.index}], "
                       f"{table.where(row)}): its first row ({table.where(kept)}) is used")
