"""What an ingest unit's lost reads become: `unreadable_fragment` rejects that carry the cause.

A fragment that fails while read is one reject for its unread rest; a unit that keeps failing (a
hang past its time limit, a worker killed out of memory again and again) is one reject per
fragment, or per range of a fragment it was to read; a row range of a table with default keys is
one reject per row, under the key its reader gives that row, so every row of the source is a
sample or a reject (`prx_core.stages.samples.units` cuts the ranges).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.row_ranges import range_label
from prx_core.sources.tables import table_key_prefix
from prx_core.store import schemas
from prx_core.store.partitions import reject_row

UNREADABLE_FRAGMENT = "unreadable_fragment"


def unreadable_fragment(source: str, fragment: str, rows_read: int, exc: Exception | str) -> pa.Table:
    """One reject row standing for the unreadable rest of a source fragment (a corrupt parquet
    file or tar shard, or a unit that kept failing): the run goes on, and the loss is visible
    with its cause."""
    name = fragment if len(fragment) < 200 else f"{fragment[:90]}...{fragment[-90:]}"  # the tail names a range
    cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    message = cause[:300] + f" (after {rows_read} rows)"
    row = reject_row(f"{source}/{name}", source, name, None, "samples", UNREADABLE_FRAGMENT, message)
    return pa.Table.from_pylist([row], schema=schemas.REJECTS)


def lost_unit(spec: SourceSpec, unit: Mapping[str, Any], message: str) -> pa.Table:
    """The rejects of a unit (its spec: `fragments`, and the `part` of its one fragment it reads)
    that kept failing: nothing of it is kept, each of its rows is accounted for as well as can be."""
    part = unit.get("part")
    if part and isinstance(part[0], int) and not spec.key_column:
        return lost_rows(spec, unit["fragments"][0], part, message)
    return pa.concat_tables([unreadable_fragment(spec.name, range_label(f, part), 0, message)
                             for f in unit["fragments"]])


def lost_rows(spec: SourceSpec, fragment: str, rows: list[int], message: str) -> pa.Table:
    """One `unreadable_fragment` reject per row of a table file's range, under the key its reader
    gives it (`<file>:<row>`, `fragment<id>:<row>` for Lance)."""
    stem = f"fragment{fragment}" if spec.format == "lance" else table_key_prefix(spec.uri, fragment)
    keys = [f"{stem}:{row}" for row in range(*rows)]
    cause = f"{message[:300]} (rows {rows[0]}-{rows[1]} of {fragment[-120:]})"
    n = len(keys)
    return schemas.table_of({"sample_id": [schemas.sample_id(spec.name, k) for k in keys], "source": [spec.name] * n,
                             "source_key": keys, "stage": ["samples"] * n, "reason": [UNREADABLE_FRAGMENT] * n,
                             "message": [cause] * n}, schemas.REJECTS)
