"""Row-range work units over a pinned Lance version: how per-source stages cut a partition.

Planning reads fragment ids and per-fragment match counts (through the partition column's
BITMAP index), never rows: the driver holds one small record per unit. A unit is a range of
matching rows within one fragment; a fragment that holds only the partition's rows (the normal
case: writers and compaction keep partitions apart) is read without a filter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa

from prx_core.compute.units import Unit
from prx_core.store import lance_io
from prx_core.store.lance_io import StorageOptions

# A shuffle's map task returns one part per bucket. Ray keeps a return under 100 KiB inline, in
# its owner's memory: the driver's. Units of one 168k-row fragment split 256 ways make ~46 KB
# parts, ~70 GB in the driver at 1B rows; map tasks are sized so that each part is over this.
PART_BYTES = 256 << 10


def plan_row_units(uri: str, predicate: str, rows_per_unit: int, storage_options: StorageOptions = None,
                   version: int | None = None) -> tuple[int, list[Unit]]:
    """(pinned version, units): per fragment, consecutive ranges of at most `rows_per_unit` rows
    matching `predicate`, in fragment order, of `version` (default: the latest). Unit ids sort in
    plan order."""
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be >= 1, got {rows_per_unit}")
    ds = lance_io.require_table(uri, storage_options)
    if version is not None:
        ds = ds.checkout_version(version)
    units = []
    for frag_id, matched in sorted(lance_io.partition_fragments(ds, predicate).items()):
        whole = matched == ds.get_fragment(frag_id).count_rows()
        for offset in range(0, matched, rows_per_unit):
            rows = min(rows_per_unit, matched - offset)
            spec = {"fragment": frag_id, "offset": offset, "limit": rows, "filtered": not whole}
            units.append(Unit(f"f{frag_id:07d}-r{offset:010d}", rows, spec))
    return ds.version, units


def scan_row_unit(uri: str, version: int, spec: dict, columns: list[str], predicate: str,
                  storage_options: StorageOptions = None, batch_size: int = 1024,
                  with_row_address: bool = False) -> Iterator[pa.RecordBatch]:
    """The unit's rows in batches (a worker's view: memory bounded by `batch_size` rows)."""
    import lance

    ds = lance.dataset(uri, version=version, storage_options=storage_options or None)
    scanner = ds.get_fragment(spec["fragment"]).scanner(
        columns=columns, filter=predicate if spec["filtered"] else None, offset=spec["offset"],
        limit=spec["limit"], batch_size=batch_size, with_row_address=with_row_address)
    yield from scanner.to_batches()


def read_row_unit(uri: str, version: int, spec: dict, columns: list[str], predicate: str,
                  storage_options: StorageOptions = None, with_row_address: bool = False) -> pa.Table:
    """The unit's rows as one table (small columns only: a unit can hold a million rows)."""
    batches = list(scan_row_unit(uri, version, spec, columns, predicate, storage_options,
                                 batch_size=1 << 16, with_row_address=with_row_address))
    if batches:
        return pa.Table.from_batches(batches)
    import lance

    schema = lance.dataset(uri, version=version, storage_options=storage_options or None).schema
    return pa.schema([schema.field(c) for c in columns]).empty_table()


def map_groups(units: Sequence[Unit], buckets: int, row_bytes: int, part_bytes: int | None = None) -> list[list[dict]]:
    """The units' specs grouped into a shuffle's map tasks, consecutive units closing a group once
    it holds `buckets * part_bytes / row_bytes` rows, so that each of its parts is at least
    `part_bytes` (`row_bytes` is a lower bound on a row's size) and a task holds ~`buckets *
    part_bytes` (64 MiB at 256 buckets; a short tail joins the last group). 1B rows make ~250
    tasks, ~64k parts."""
    want = -(-buckets * (PART_BYTES if part_bytes is None else part_bytes) // max(row_bytes, 1))
    groups: list[list[dict]] = []
    current: list[dict] = []
    rows = 0
    for unit in units:
        current.append(dict(unit.spec))
        rows += unit.rows
        if rows >= want:
            groups.append(current)
            current, rows = [], 0
    if current and groups and rows < want:  # a short tail joins the last group: no small parts
        groups[-1].extend(current)
    elif current:
        groups.append(current)
    return groups


def read_row_units(uri: str, version: int, specs: Sequence[dict], columns: list[str], predicate: str,
                   storage_options: StorageOptions = None, with_row_address: bool = False) -> pa.Table:
    """A map task's rows: its units' (`map_groups`) in order, as one table."""
    return pa.concat_tables([read_row_unit(uri, version, spec, columns, predicate, storage_options, with_row_address)
                             for spec in specs])
